"""Do drafts trained on vLLM's records learn as much as drafts trained on TIDE's?

`python scripts/vllm_capture_parity.py --start-draft DIR [--requests 96] [--steps 400] [--seeds 0 1 2] [--census-only] --out report.json`

One traffic, served with capture on into a real broker: once by TIDE's engine (workload
`parity-tide`) and once by vLLM with the tap (`parity-vllm`), both in bf16 with the same start draft
at γ 3, greedy, the same prompts (chat_fr, train part) and `--max-new-tokens`. Then `tide train`
runs `--steps` steps on each topic from the start draft once per seed (both sources, seed after
seed: the report, rewritten after each pair, compares whatever pairs are done), alike in every flag, and each
draft's held-out τ is measured the same way: tokens per step in TIDE's engine (fp32, γ 3, greedy) on
chat_fr's test part, which no trainer saw. A seed fixes which examples the trainer samples, so the
two sources are compared seed by seed; the spread over seeds is the noise the ratio is read against.
Needs `.venv-vllm` (`make vllm`). Each training takes 5–10 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch
from confluent_kafka.admin import AdminClient
from tqdm import tqdm

from tide.infra.kafka.broker import KafkaBroker
from tide.models.hf_folder import write_hf_folder
from tide.models.loader import load_target
from tide.names import trainer_group
from tide.producers.assembler import RequestAssembler
from tide.producers.consumer import RecordConsumer
from tide.producers.publisher import PublisherConfig, RecordPublisher
from tide.producers.records import HiddenStateRecord
from tide.prompts import WORKLOADS, load_prompts, split
from tide.serving.engine import Engine, EngineConfig
from tide.serving.sampling import SamplingParams
from tide.serving.vllm_adapter.config import TapConfig, VllmConfig
from tide.serving.vllm_adapter.process import VllmProcess
from tide.trainers.checkpoint import checkpoints_dir, current_checkpoint
from tide.trainers.export import export_speculators

GAMMA = 3
SOURCES = ("parity-tide", "parity-vllm")


def tau(draft: Path | None, prompts: list[list[int]], new_tokens: int) -> float:
    target = load_target(None, torch.float32)
    engine = Engine(target, None, EngineConfig(max_batch=1, max_model_len=1024, gamma=GAMMA))
    if draft is not None:
        engine.load_draft(draft)
        engine.swap_pending_drafts()
    for p in prompts:
        engine.generate([p], SamplingParams(max_tokens=new_tokens))
    return float(engine.stats.mean_accept_length)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--start-draft", type=Path, required=True)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--eval-prompts", type=int, default=32)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--census-only", action="store_true", help="capture both sources and count, no training")
    a = ap.parse_args()
    fr = load_prompts(WORKLOADS / "chat_fr.jsonl")
    bf16 = load_target(None, torch.bfloat16)
    traffic = [p.token_ids(bf16.tok)[-200:] for p in split(fr, "train")[: a.requests]]
    held = [p.token_ids(bf16.tok)[-200:] for p in split(fr, "test")[: a.eval_prompts]]
    tide = Path(sys.executable).parent / "tide"
    report: dict[str, object] = {"requests": len(traffic), "steps": a.steps, "gamma": GAMMA, "seeds": a.seeds,
                                 "eval_prompts": len(held)}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="tide-parity-") as tmp, KafkaBroker(Path(tmp) / "kafka") as kafka:
        work = Path(tmp)
        publisher = RecordPublisher(PublisherConfig(kafka.bootstrap, "int8-g64"), bf16.fingerprint)
        engine = Engine(bf16, None, EngineConfig(max_batch=8, max_model_len=1024, gamma=GAMMA), tap=publisher)
        engine.load_draft(a.start_draft)
        for i, p in enumerate(traffic):
            engine.add(p, SamplingParams(max_tokens=a.max_new_tokens), f"tide-{i}", workload=SOURCES[0])
        while engine.has_work:
            engine.step()
        publisher.close()
        report["tide_records"] = publisher.stats.records_published
        folder, fp = write_hf_folder(None)
        spec = export_speculators(a.start_draft, work / "spec", verifier_name_or_path=str(folder),
                                  speculative_tokens=GAMMA)  # fmt: skip
        cfg = VllmConfig(folder, spec, GAMMA, "bfloat16", 1024, 8, torch.get_num_threads(),
                         tap=TapConfig(kafka.bootstrap, fp))  # fmt: skip
        with VllmProcess(cfg) as vllm:
            vllm.generate(traffic, a.max_new_tokens, workload=SOURCES[1])
            report["vllm_records"] = vllm.flush_tap()["records_published"]
        # what each trainer can learn from: the held-out share is decided per node (by request id, and
        # more while the gate's window is short), so the two sources need not train on as many requests
        report["census"] = {name: census(kafka.bootstrap, name, bf16.fingerprint) for name in SOURCES}
        if a.census_only:
            a.out.write_text(json.dumps(report, indent=2) + "\n")
            print(json.dumps(report, indent=2), flush=True)
            return
        start = tau(a.start_draft, held, 64)
        taus: dict[str, list[float]] = {name: [] for name in SOURCES}
        steps: dict[str, list[int]] = {name: [] for name in SOURCES}  # a run cut short is not comparable
        # seed by seed, both sources: whatever pairs are done when the run is stopped are comparable
        for i, seed in enumerate(tqdm(a.seeds, desc="seeds", unit="seed")):
            for name in SOURCES:
                if i:  # each seed reads the topic from its start: the trainer's group forgets the offsets
                    admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
                    admin.delete_consumer_groups([trainer_group(name)])[trainer_group(name)].result(60)
                state = work / f"{name}-{seed}"
                # --idle-seconds counts replayed steps as idle: long enough that --max-steps ends every run
                run = subprocess.run([str(tide), "train", "--kafka", kafka.bootstrap, "--workload", name, "--start-draft",
                                str(a.start_draft), "--state-dir", str(state), "--max-steps", str(a.steps),
                                "--idle-seconds", "3600", "--checkpoint-every", str(a.steps), "--eval-every", "100",
                                "--seed", str(seed)], check=True, stdout=subprocess.PIPE, text=True)  # fmt: skip
                steps[name].append(json.loads(run.stdout.strip().splitlines()[-1])["steps"])
                ckpt = current_checkpoint(checkpoints_dir(state))
                assert ckpt is not None, f"{name} seed {seed}: no checkpoint"
                taus[name].append(tau(ckpt / "draft", held, 64))
                print(name, seed, taus[name][-1], flush=True)
            write_report(report, start, taus, steps, a.out)


def census(bootstrap: str, workload: str, fingerprint: str) -> dict[str, float]:
    """What a trainer of the workload reads: requests and completion positions, training and held out
    apart, and how many pieces the requests join into (a request whose records do not join is
    learnt from in pieces, each without the context before it)."""
    reader = RecordConsumer(bootstrap, [workload], f"census-{uuid.uuid4().hex[:6]}", fingerprint)
    joiner = RequestAssembler()
    pieces: list[HiddenStateRecord] = []
    idle = time.monotonic()
    while time.monotonic() - idle < 10:  # until nothing more comes for 10 s
        for c in reader.poll(256, 1.0):
            pieces += joiner.add(c.record)
            idle = time.monotonic()
    reader.close()
    pieces += joiner.flush(everything=True)
    out: dict[str, float] = {}
    for kind, held in (("train", False), ("held_out", True)):
        mine = [r for r in pieces if r.held_out == held]
        out[f"{kind}_requests"] = len({r.request_id for r in mine})
        out[f"{kind}_pieces"] = len(mine)
        out[f"{kind}_positions"] = sum(int((~r.prefill).sum()) for r in mine)
        out[f"{kind}_prompt_positions"] = sum(int(r.prefill.sum()) for r in mine)
    return out


def write_report(
    report: dict[str, object],
    start: float,
    taus: dict[str, list[float]],
    steps: dict[str, list[int]],
    out: Path,
) -> None:
    """The pairs so far: τ per source and seed, their ratio seed by seed, and the spread over seeds."""
    t = {name: torch.tensor(v) for name, v in taus.items()}
    report["tau"] = {"start": start, **taus}
    report["steps_trained"] = steps
    report["vllm_over_tide_by_seed"] = (t["parity-vllm"] / t["parity-tide"]).tolist()
    report["vllm_over_tide"] = float(t["parity-vllm"].mean() / t["parity-tide"].mean())
    report["spread_over_seeds"] = {name: float((v.max() - v.min()) / v.mean()) for name, v in t.items()}
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2), flush=True)


if __name__ == "__main__":
    main()
