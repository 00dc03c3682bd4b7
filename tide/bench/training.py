"""`tide bench training`: the same draft trained on the same traffic, in the same order, one pass, twice.

- TIDE: the hidden states were captured while serving; the trainer reads and decodes them from Kafka.
- Baseline (SpecForge's online mode): the trainer gets only the token ids and re-runs the target's
  prefill over every request to recompute the states.

Traffic is served in slices of requests; after each slice TIDE's trainer catches up on the new
records, as a trainer that keeps up with serving does. The topic is sized as a trainer sizes it
(`trainers/topic_sizer.py`): from the traffic rate measured on the records read, to keep what a
trainer a slice and a half behind still needs. Storage is what a live deployment holds: the topic's
log segments on disk plus the replay buffer saved as a checkpoint saves it (in the record codec),
each measured at its peak, against SpecForge's offline cache of every hidden state in raw bf16.
Both trainers train with the broker up, so both share the machine's cores with it.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from tide.infra.kafka.broker import KafkaBroker
from tide.models.eagle3 import DraftConfig, Eagle3Draft
from tide.models.loader import Target, load_target
from tide.names import topic_for
from tide.producers.consumer import RecordConsumer
from tide.producers.publisher import PublisherConfig, RecordPublisher
from tide.producers.records import DEFAULT_CODEC, is_held_out
from tide.producers.topics import TopicConfig, TopicSizing, TrafficMeter
from tide.prompts import load_prompts
from tide.serving.engine import Engine, EngineConfig
from tide.serving.sampling import SamplingParams
from tide.serving.sequence import Sequence
from tide.trainers.checkpoint import Ledger, save_examples
from tide.trainers.examples import example_of
from tide.trainers.topic_sizer import TopicSizer
from tide.trainers.ttt import Example, TrainConfig, Trainer, init_draft_head, select_vocab

WORKLOAD = "bench"
CHUNK = 128


@dataclass
class TrainingBenchConfig:
    prompts: Path
    requests: int = 600  # the prompt file is cycled (sampled answers) until this many were served
    max_new_tokens: int = 160
    slice_requests: int = 8  # served between two catch-ups of the trainer
    batch_size: int = 4
    replay_positions: int = 2048
    keep_slices: float = 1.5  # the topic is sized to keep this many slices' traffic: the trainer's lag here
    codec: str = DEFAULT_CODEC  # the records', and the replay buffer's
    draft_vocab: int = 4096
    held_out_percent: int = 10
    model: str | None = None
    weights: str = "auto"  # the serving target's linears (`tide.models.weights`)


def _topic_bytes(log_dir: Path) -> int:
    """Disk blocks the workload topic's partitions hold (index files are sparse: size would overstate)."""
    return sum(
        p.stat().st_blocks * 512
        for d in log_dir.glob(f"{topic_for(WORKLOAD)}-*")
        for p in d.rglob("*")
        if p.is_file()
    )


def run_training_bench(cfg: TrainingBenchConfig) -> dict[str, Any]:
    target = load_target(cfg.model, weights=cfg.weights, compile=cfg.weights != "bf16")
    tok, mcfg = target.tok, target.config
    lm_head = target.model.lm_head.weight.detach().float()
    embed = torch.nn.Embedding.from_pretrained(target.model.embed_tokens.weight.detach().float(), freeze=True)
    prompts = [p.token_ids(tok)[-384:] for p in load_prompts(cfg.prompts)]
    traffic = [prompts[i % len(prompts)] for i in range(cfg.requests)]
    topics = TopicConfig()  # as a node makes it: sized once the trainer has measured the traffic
    served: list[Sequence] = []
    report: dict[str, Any] = {
        "weights": target.weights,
        "requests": cfg.requests,
        "codec": cfg.codec,
        "keep_slices": cfg.keep_slices,
    }

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        broker_extra = {"log.retention.check.interval.ms": "500", "log.segment.delete.delay.ms": "0"}
        with KafkaBroker(tmp / "kafka", extra=broker_extra) as broker:
            pcfg = PublisherConfig(broker.bootstrap, cfg.codec, CHUNK, topics=topics)
            publisher = RecordPublisher(pcfg, target.fingerprint)
            engine = Engine(
                target, None, EngineConfig(max_batch=16, max_model_len=1024, gamma=0), tap=publisher
            )
            consumer = RecordConsumer(
                broker.bootstrap, [WORKLOAD], "bench-trainer", target.fingerprint, topics
            )
            tide: Trainer | None = None
            sizer: TopicSizer | None = None
            meter = TrafficMeter()  # the topic's rate, as a trainer measures it
            init_state: dict[str, torch.Tensor] = {}
            batches: list[list[str]] = []  # the keys of every training batch, in TIDE's order
            replay: list[Example] = []
            decode_s = label_s = train_s = 0.0
            peak_topic = peak_replay = 0
            consumed = lost = 0
            log_dir = tmp / "kafka" / "logs"
            for start in tqdm(range(0, cfg.requests, cfg.slice_requests), desc="serve + train", unit="slice"):
                slice_start = time.monotonic()
                # serve a slice with capture on
                seqs = [
                    engine.add(
                        p,
                        SamplingParams(temperature=0.7, seed=start + i, max_tokens=cfg.max_new_tokens),
                        workload=WORKLOAD,
                    )
                    for i, p in enumerate(traffic[start : start + cfg.slice_requests])
                ]
                while engine.has_work:
                    engine.step()
                served += seqs
                publisher.flush(60)
                peak_topic = max(peak_topic, _topic_bytes(log_dir))
                # the trainer catches up on the slice's records
                fresh: list[tuple[str, Example]] = []
                quiet_since = time.monotonic()
                while consumed < publisher.stats.records_published - lost:
                    t = time.perf_counter()
                    got = consumer.poll(64, 0.05)
                    if not got:
                        if (
                            time.monotonic() - quiet_since > 10
                        ):  # retention deleted them before they were read
                            lost = publisher.stats.records_published - consumed
                        continue
                    decode_s += time.perf_counter() - t  # reading and decoding; idle polls are not counted
                    quiet_since = time.monotonic()
                    consumed += len(got)
                    t = time.perf_counter()
                    for c in got:
                        meter.add(c.record.created_at, c.size)
                        if is_held_out(c.record.request_id, cfg.held_out_percent):
                            continue  # both drafts are evaluated on the baseline's exact states
                        ex = example_of(c.record, None)
                        if ex is not None:
                            fresh.append((f"{c.record.request_id}:{c.record.chunk}", ex))
                    label_s += time.perf_counter() - t
                if tide is None:  # the draft both sides start from: vocabulary from the first slice
                    draft = Eagle3Draft(
                        DraftConfig.for_target(mcfg, target.fingerprint, cfg.draft_vocab), embed
                    )
                    draft.set_vocab(select_vocab([e for _, e in fresh], cfg.draft_vocab, mcfg.vocab_size))
                    init_draft_head(draft, lm_head)
                    init_state = {k: v.clone() for k, v in draft.state_dict().items()}
                    warm = Eagle3Draft(draft.cfg, embed)
                    warm.load_state_dict(init_state)
                    Trainer(warm, lm_head, TrainConfig()).step([e for _, e in fresh[:4]])  # first-call costs
                    tide = Trainer(draft, lm_head, TrainConfig(batch_size=cfg.batch_size, seed=0))
                    torch.manual_seed(0)
                t = time.perf_counter()
                for i in range(0, len(fresh), cfg.batch_size):
                    chunk = fresh[i : i + cfg.batch_size]
                    tide.step([e for _, e in chunk])
                    batches.append([k for k, _ in chunk])
                train_s += time.perf_counter() - t
                replay += [e for _, e in fresh]
                while sum(len(e.aux) for e in replay) > cfg.replay_positions:
                    replay.pop(0)
                if replay:
                    save_examples(replay, tmp / "replay.safetensors", cfg.codec)
                    peak_replay = max(peak_replay, (tmp / "replay.safetensors").stat().st_size)
                if sizer is None:  # the trainer's lag: a slice served, read and trained on
                    keep = cfg.keep_slices * (time.monotonic() - slice_start)
                    sizer = TopicSizer(broker.bootstrap, WORKLOAD, TopicSizing(keep), 0.0, Ledger())
                sizer(meter)
            peak_topic = max(peak_topic, _topic_bytes(log_dir))
            assert tide is not None
            report["topic"] = dataclasses.asdict(sizer.applied) if sizer and sizer.applied else None
            report["traffic_bytes_per_s"] = meter.rate()
            # the baseline trains in TIDE's surroundings, the broker and TIDE's clients up: they share
            # these cores (a deployment's broker has its own); trained alone afterwards, the same 250
            # steps took the baseline 160.5 s against TIDE's 183.9 s
            keyed, held, prefill_s, base_label_s = _recompute_states(target, served, cfg.held_out_percent)
            draft = Eagle3Draft(DraftConfig.for_target(mcfg, target.fingerprint, cfg.draft_vocab), embed)
            draft.load_state_dict(init_state)
            base = Trainer(draft, lm_head, TrainConfig(batch_size=cfg.batch_size, seed=0))
            torch.manual_seed(0)
            t = time.perf_counter()
            for keys in tqdm(batches, desc="baseline training", unit="step"):
                base.step([keyed[k] for k in keys])
            base_train_s = time.perf_counter() - t
            consumer.close()
            publisher.close()
            published_bytes = publisher.stats.bytes_published

    positions = sum(len(s.prompt) + len(s.output) - 1 for s in served)
    # evaluation labels (the target's argmax) for the held-out requests, outside every timing
    held = [Example.make(e.tokens, e.aux, e.hidden, lm_head, e.learn_from) for e in held]
    tide_tau = tide.evaluate(held).tau[-1]
    base_tau = base.evaluate(held).tau[-1]
    offline = positions * 4 * mcfg.hidden_size * 2  # every aux + final state, raw bf16
    storage = peak_topic + peak_replay
    tide_s = decode_s + label_s + train_s
    baseline_s = prefill_s + base_label_s + base_train_s
    report.update(
        {
            "positions": positions,
            "training_steps": len(batches),
            "tide_seconds": tide_s,
            "tide_decode_seconds": decode_s,
            "tide_label_seconds": label_s,
            "tide_train_seconds": train_s,
            "baseline_prefill_seconds": prefill_s,
            "baseline_label_seconds": base_label_s,
            "baseline_train_seconds": base_train_s,
            "baseline_seconds": baseline_s,
            "speedup": baseline_s / tide_s,
            "speedup_expected": (prefill_s + base_label_s + base_train_s) / (base_label_s + base_train_s),
            "decode_share": decode_s / tide_s,
            "tide_tau": tide_tau,
            "baseline_tau": base_tau,
            "tau_ratio": tide_tau / base_tau,
            "storage_bytes_offline": offline,
            "storage_bytes_tide": storage,
            "storage_topic_peak_bytes": peak_topic,
            "storage_replay_peak_bytes": peak_replay,
            "published_bytes": published_bytes,
            "records_lost_to_retention": lost,
            "codec_factor": offline / published_bytes,
            "retention_factor": published_bytes / peak_topic,
            "storage_ratio": offline / storage,
        }
    )
    return report


def _recompute_states(
    target: Target, served: list[Sequence], held_out_percent: int
) -> tuple[dict[str, Example], list[Example], float, float]:
    """The baseline's states: the target's prefill over every served request's tokens, cut into the
    records' chunks. Returns the training examples by record key, the held-out ones (unlabelled), and
    the seconds spent on prefill and on making examples."""
    keyed: dict[str, Example] = {}
    held: list[Example] = []
    t = time.perf_counter()
    with torch.inference_mode():
        for s in tqdm(served, desc="baseline prefill", unit="request"):
            tokens = torch.tensor(s.prompt + s.output)
            out = target.model.forward_once(tokens[:-1].unsqueeze(0), capture_aux=True)
            assert out.aux is not None
            aux, hidden = out.aux[0].to(torch.bfloat16), out.hidden[0].to(torch.bfloat16)
            n = len(tokens) - 1
            for index, first in enumerate(range(0, n, CHUNK)):
                end = min(n, first + CHUNK)
                m, k = end - first, min(max(len(s.prompt) - first, 0), end - first)
                learn = max(0, k - 1) if k < m else m  # as `example_of` reads a record's prefill mask
                keyed[f"{s.request_id}:{index}"] = Example(tokens[first:end], aux[first:end], hidden[first:end],
                                                          torch.empty(0, dtype=torch.long), learn)  # fmt: skip
    prefill_s = time.perf_counter() - t
    t = time.perf_counter()
    for key, ex in list(keyed.items()):
        if is_held_out(key.split(":")[0], held_out_percent):
            del keyed[key]
            held.append(ex)
        else:
            keyed[key] = Example.make(ex.tokens, ex.aux, ex.hidden, None, ex.learn_from)
    return keyed, held, prefill_s, time.perf_counter() - t
