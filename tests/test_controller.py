"""The runtime controller: gamma from the cost model and per-depth acceptance, off where it does not
pay (with exploration), the shift detector, and step times corrected by what serving measures."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import cast
from unittest import mock

import torch

from tests.conftest import tiny_draft, tiny_target, trained_tiny_draft
from tide.models.eagle3 import Eagle3Draft
from tide.models.loader import Target
from tide.registry.profile import StepProfile, alphas_from_taus
from tide.serving.controller import (
    PRIOR_ALPHA,
    Controller,
    ControllerConfig,
    GammaChoice,
    build_controller,
)
from tide.serving.engine import Engine, EngineConfig
from tide.serving.sampling import SamplingParams

# CPU-like: verifying more tokens costs little more than decoding one, drafting is cheap
FLAT = StepProfile(1, {n: 0.020 + 0.0005 * (n - 1) for n in range(1, 10)}, 0.001)
# this machine at batch 1: a draft that misses costs more than its verify pass saves
CPU = StepProfile(1, {n: 0.016 + 0.0006 * (n - 1) for n in range(1, 10)}, 0.0015)
# the default model's int4 target and draft at batch 1 on two cores (measured): a draft token costs
# under a tenth of a decode step, and a verify of 5 tokens or more takes another kernel path
TWO_CORES = StepProfile(
    1,
    {1: 0.0083, 2: 0.0097, 3: 0.0109, 4: 0.0119, 5: 0.0172, 6: 0.0173, 7: 0.0180},
    0.0007,
    draft_next=0.0004,
)
# GPU-at-large-batch-like: every extra token per sequence costs almost a whole step
STEEP = StepProfile(16, {n: 0.020 * n for n in range(1, 10)}, 0.004)


def feed(
    c: Controller, workload: str, accepted_per_step: int, gamma: int, steps: int, batch: int = 1
) -> None:
    """Steps taking exactly their profiled time, so only acceptance changes."""
    for _ in range(steps):
        seconds = c.costs.step_time(batch, gamma)
        c.observe([workload] * batch, torch.full((batch,), accepted_per_step), gamma, seconds)


def test_gamma_follows_acceptance_and_cost() -> None:
    c = Controller(ControllerConfig(max_gamma=6), [FLAT])
    feed(c, "code", 6, 6, 200)  # every draft accepted
    assert c.choose(["code"]).gamma == 6
    feed(c, "chat", 1, 6, 200)  # only the first draft token accepted: deeper drafting wastes time
    d = c.choose(["chat"])
    assert 1 <= d.gamma <= 2 and d.predicted_speedup > 1.0
    steep = Controller(ControllerConfig(max_gamma=6), [STEEP])
    feed(steep, "chat", 1, 6, 200, batch=16)
    assert steep.choose(["chat"] * 16).gamma == 0  # at a steep cost curve the same acceptance does not pay


def explored_share(c: Controller, chosen: list[GammaChoice]) -> float:
    """The predicted time the exploring steps spent beyond what was chosen, over all steps' time."""
    t = c.costs.step_time
    extra = sum(t(1, d.gamma) - t(1, d.gamma - 1) for d in chosen if d.explore)
    return extra / sum(t(1, d.gamma) for d in chosen)


def test_off_where_it_does_not_pay_but_keeps_exploring() -> None:
    c = Controller(ControllerConfig(max_gamma=4), [FLAT])
    feed(c, "fr", 0, 4, 300)  # nothing accepted
    picks = []
    for _ in range(64):
        picks.append(d := c.choose(["fr"]))
        c.observe(["fr"], torch.tensor([0]), d.gamma, c.costs.step_time(1, d.gamma))
    assert all(d.gamma in (0, 1) for d in picks) and all(d.explore for d in picks if d.gamma)
    assert 0.5 * c.cfg.explore_share < explored_share(c, picks) <= c.cfg.explore_share
    assert not c.pays("fr")
    # a new draft arrives and explored steps find it good: speculation comes back by itself
    c.draft_changed(["fr"])
    for d in (c.choose(["fr"]) for _ in range(200)):
        c.observe(["fr"], torch.tensor([d.gamma]), d.gamma, c.costs.step_time(1, d.gamma))
    assert c.choose(["fr"]).gamma >= 3 and c.pays("fr")


def test_a_new_draft_starts_from_what_the_gate_measured() -> None:
    assert [round(a, 3) for a in alphas_from_taus({1: 1.8, 2: 2.44, 3: 2.7})] == [0.8, 0.8, 0.406]
    assert alphas_from_taus({1: 1.0, 2: 1.0}) == [0.01, 0.01]  # nothing accepted: unlikely, not impossible
    c = Controller(ControllerConfig(max_gamma=6), [FLAT])
    c.draft_changed(
        ["poor"], {1: 1.05, 2: 1.06, 3: 1.06, 4: 1.06}
    )  # poor on today's traffic: not tried first
    assert c.choose(["poor"]).gamma == 0
    c.draft_changed(["good"], {1: 1.9, 2: 2.7, 3: 3.4, 4: 4.0})
    assert c.choose(["good"]).gamma >= 4  # deeper depths start from the deepest the gate measured
    c.draft_changed(["unknown"])  # no measurement: the optimistic prior, so the draft gets tried
    assert c.choose(["unknown"]).gamma >= 1


def serve(c: Controller, rate: Callable[[int], float], steps: int, seed: int = 0) -> list[GammaChoice]:
    """Steps at the controller's gamma whose drafts are each accepted with probability rate(step),
    taking exactly their profiled time; what it chose."""
    rng = random.Random(seed)
    chosen = []
    for i in range(steps):
        d = c.choose(["w"])
        a = 0
        while a < d.gamma and rng.random() < rate(i):
            a += 1
        c.observe(["w"], torch.tensor([a]), d.gamma, c.costs.step_time(1, d.gamma))
        chosen.append(d)
    return chosen


def test_steady_traffic_keeps_its_gamma_and_raises_no_shift() -> None:
    c = Controller(ControllerConfig(max_gamma=6), [CPU])
    chosen = [d.gamma for d in serve(c, lambda i: 0.7, 20_000)]
    top = max(set(chosen), key=chosen.count)
    assert sum(1 for g in chosen if abs(g - top) <= 1) > 0.95 * len(chosen), Counter(chosen)
    assert not c.shifted("w") and not c.needs_training("w") and c.pays("w")


def test_a_collapse_turns_speculation_off_within_a_few_dozen_steps_and_calls_for_training() -> None:
    c = Controller(ControllerConfig(max_gamma=6), [CPU])
    serve(c, lambda i: 0.7, 3000)
    served = serve(c, lambda i: 0.0, 600, seed=1)
    chosen = [d.gamma for d in served]
    assert chosen.index(0) < 32 and c.shifted("w"), chosen[:40]
    checks = served[64:]
    assert {d.gamma for d in checks} == {0, 1}  # one token, within the exploration's share of time
    assert 0.5 * c.cfg.explore_share < explored_share(c, checks) <= c.cfg.explore_share
    assert c.needs_training("w") and not c.pays("w")


def test_bursts_of_easy_and_hard_stretches_keep_a_paying_draft_on() -> None:
    """Code's acceptance comes in bursts (boilerplate, then a hard stretch) around a rate that pays.
    Read as independent outcomes, hard stretches looked like falls and turned speculation off for
    hundreds of steps (0.93-0.95 of the best fixed gamma of 1-3 here over six seeds); measuring the
    overdispersion keeps it on (0.97-0.98)."""
    c = Controller(ControllerConfig(max_gamma=6), [TWO_CORES])
    rng = random.Random(1)
    rates: list[float] = []
    while len(rates) < 20_000:
        rates += [rng.choice((0.55, 0.3))] * rng.randint(20, 60)
    served, fixed = throughput(c, rates, None), max(throughput(c, rates, g) for g in (1, 2, 3))
    assert served > 0.96 * fixed and c.tracker("w").dispersion > 1.2, (served / fixed, c.snapshot())


def throughput(c: Controller, rates: list[float], gamma: int | None) -> float:
    """Tokens per second at profiled step times, serving `rates` (one per step) at the controller's
    gamma (None) or a fixed one."""
    rng, seconds, tokens = random.Random(7), 0.0, 0
    for rate in rates:
        g = c.choose(["w"]).gamma if gamma is None else gamma
        a = 0
        while a < g and rng.random() < rate:
            a += 1
        t = c.costs.step_time(1, g)
        if gamma is None:
            c.observe(["w"], torch.tensor([a]), g, t)
        seconds, tokens = seconds + t, tokens + a + 1
    return tokens / seconds


def test_checks_pay_what_they_measured() -> None:
    """A check that takes twice its predicted extra time (the draft catching up on what it skipped)
    comes about half as often: exploration keeps to its share of the time measured."""
    c = Controller(ControllerConfig(max_gamma=6), [CPU])
    serve(c, lambda i: 0.7, 3000)
    serve(c, lambda i: 0.0, 600, seed=1)
    t, spent, total, checks = c.costs.step_time, 0.0, 0.0, 0
    for _ in range(3000):
        d = c.choose(["w"])
        extra = 2 * (t(1, d.gamma) - t(1, d.gamma - 1)) if d.explore else 0.0
        seconds = t(1, d.gamma - d.explore) + extra
        c.observe(["w"], torch.tensor([0]), d.gamma, seconds)
        spent, total, checks = spent + extra, total + seconds, checks + d.explore
    assert 0.8 * c.cfg.explore_share < spent / total <= 1.05 * c.cfg.explore_share, (spent / total, checks)
    at_prediction = 3000 * c.cfg.explore_share * t(1, 0) / (t(1, 1) - t(1, 0))
    assert checks < 0.6 * at_prediction, (checks, at_prediction)


def test_one_hard_request_is_no_shift_and_does_not_call_for_training() -> None:
    c = Controller(ControllerConfig(max_gamma=6), [CPU])
    serve(c, lambda i: 0.7, 3000)
    serve(c, lambda i: 0.0 if i < 60 else 0.7, 400, seed=1)  # a request where nothing lands, then as before
    assert not c.shifted("w") and not c.needs_training("w") and c.pays("w")


def test_speculation_comes_back_within_a_few_checks_when_the_draft_fits_again() -> None:
    c = Controller(ControllerConfig(max_gamma=6), [CPU])
    serve(c, lambda i: 0.7, 3000)
    serve(c, lambda i: 0.05, 3000, seed=1)  # the code draft on French: off, checking
    assert not c.pays("w")
    chosen = serve(c, lambda i: 0.8, 400, seed=2)  # code again
    resumed = next(i for i, d in enumerate(chosen) if d.gamma and not d.explore)
    checks = sum(1 for d in chosen[:resumed] if d.explore)
    assert checks <= 8 and c.pays("w") and not c.shifted("w"), (resumed, checks)
    assert max(d.gamma for d in chosen[-32:]) >= 3  # deeper depths come back with the first


def test_lucky_checks_while_off_do_not_turn_speculation_on() -> None:
    """The code draft on French is right about once in 20: over an hour of checks, the detector's
    false rises cost a handful of drafted steps."""
    c = Controller(ControllerConfig(max_gamma=6), [CPU])
    serve(c, lambda i: 0.7, 3000)
    chosen = serve(c, lambda i: 0.05, 30_000, seed=3)
    drafted = sum(1 for d in chosen if d.gamma and not d.explore)
    assert drafted < 0.01 * len(chosen), drafted


def test_step_times_are_corrected_by_measurements() -> None:
    c = Controller(ControllerConfig(max_gamma=4), [FLAT])
    before = c.costs.step_time(1, 4)
    for _ in range(200):
        c.observe(["w"], torch.tensor([0]), 4, 2 * before)  # the machine is twice as slow as profiled
    assert abs(c.costs.step_time(1, 4) / before - 2) < 0.05
    # nothing accepted: each step yields one token at the cost of drafting four
    expected = c.costs.step_time(1, 0) / c.costs.step_time(1, 4)
    assert expected < 0.9 and abs(c.measured_speedup - expected) < 0.02


def test_adaptive_engine_is_lossless_and_turns_a_bad_draft_off() -> None:
    target = tiny_target(seed=5, scale=2.0)
    bad = tiny_draft(target, seed=7)
    with torch.no_grad():
        bad.lm_head.weight.normal_(0, 1.0)  # predicts noise
    prompts = [[i, i + 3, i + 5] for i in range(8)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ref = Engine(target, None, EngineConfig(max_batch=4, max_model_len=64, gamma=0)).generate(prompts, params)
    profile = StepProfile(4, {n: 0.010 + 0.0002 * n for n in range(1, 8)}, 0.0005)
    for draft in (trained_tiny_draft(target, seed=6, vocab=128), bad):
        controller = Controller(ControllerConfig(max_gamma=6, explore_share=0.05), [profile])
        engine = Engine(target, draft, EngineConfig(max_batch=4, max_model_len=64, gamma=4, max_gamma=6),
                        controller=controller)  # fmt: skip
        for _ in range(3):  # whatever gamma each step gets, greedy output is the plain decode's
            seqs = engine.generate(prompts, params)
            assert [s.output for s in seqs] == [r.output for r in ref]
    assert not controller.pays("default"), controller.snapshot()
    assert engine.stats.steps > 0  # explored while off


def test_the_chain_stops_where_the_draft_is_unsure() -> None:
    """stop_below 1.0: no chain is ever sure enough for a second token; 0: always gamma tokens.
    Greedy output is the plain decode's either way, and sampling runs with the shorter chains."""
    target = tiny_target(seed=5, scale=2.0)
    draft = trained_tiny_draft(target, seed=6, vocab=128)
    prompts = [[i, i + 3, i + 5] for i in range(4)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ref = Engine(target, None, EngineConfig(max_batch=4, max_model_len=64, gamma=0)).generate(prompts, params)
    profile = StepProfile(4, {n: 0.010 for n in range(1, 8)}, 0.0001)  # deeper always predicted to pay
    widths: dict[float, set[int]] = {}
    for stop in (1.0, 0.0):
        controller = Controller(ControllerConfig(max_gamma=4, stop_below=stop), [profile])
        seen = widths[stop] = set()

        def record(
            w: list[str],
            a: torch.Tensor,
            gamma: int,
            t: float,
            seen: set[int] = seen,
            c: Controller = controller,
        ) -> None:
            seen.add(gamma)  # the tokens each step drafted
            Controller.observe(c, w, a, gamma, t)

        controller.observe = record  # type: ignore[assignment]
        engine = Engine(target, draft, EngineConfig(max_batch=4, max_model_len=64, gamma=4, max_gamma=4),
                        controller=controller)  # fmt: skip
        assert [s.output for s in engine.generate(prompts, params)] == [r.output for r in ref]
        sampled = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0.8, ignore_eos=True))
        assert all(len(s.output) == 24 for s in sampled)
    assert widths[1.0] <= {0, 1}, widths
    assert max(widths[0.0]) >= 3, widths


def test_adaptive_on_the_default_model(target_native: Target, trained_draft_dir: Path) -> None:
    """SmolLM2 with its code draft, batches of 4, code and French in the same engine (one workload
    label each): off for French, which the code draft does not fit; code as the measured step costs
    say (about 1.1x predicted on an idle two-core machine, French about 0.8x)."""
    from tide.prompts import load_prompts, split

    from .conftest import WORKLOADS

    model = target_native.model
    draft = Eagle3Draft.load(
        trained_draft_dir, model.embed_tokens, target_native.config, target_native.fingerprint, model.dtype
    )
    controller = build_controller(
        model, draft, ControllerConfig(max_gamma=6), max_batch=4, batch_sizes=(1, 4)
    )
    engine = Engine(target_native, draft, EngineConfig(max_batch=4, max_model_len=512, gamma=4, max_gamma=6),
                    controller=controller)  # fmt: skip
    params = SamplingParams(max_tokens=48)
    for name, workload in (("code.jsonl", "code"), ("chat_fr.jsonl", "fr")):
        for p in split(load_prompts(WORKLOADS / name), "test")[:8]:
            engine.add(p.token_ids(target_native.tok)[-200:], params, workload=workload)
        while engine.has_work:
            engine.step()
    # what it decided, not how fast it ran: wall-clock speed is the benchmarks' to measure. Whether
    # code pays at batch 4 depends on this machine's step times and on how far the draft got in its
    # training budget here (on one CI machine code's depth-1 acceptance was 0.48 and it did not pay),
    # so code is held to what the draft is, not to this machine's speed: it fits code at least as well
    # as French (0.42 against 0.20 on that machine). Not strictly: on another, two unlucky first steps
    # turned code off at once, and these few requests then held only a check or two per workload, so
    # both long averages stayed where those first steps left them (0.25 each); the served test below
    # compares the fit on more drafted steps.
    snap = controller.snapshot()
    code, fr = snap["code"], snap["fr"]
    assert cast(list[float], code["alpha"])[0] >= cast(list[float], fr["alpha"])[0], snap
    assert not fr["speculation"], snap


def test_served_decisions_per_workload(trained_draft_dir: Path, tmp_path: Path) -> None:
    """`tide serve --gamma auto`: decisions per workload on /admin and /metrics alike. The draft fits
    code far better than French: French is not speculated unless code is, and code, if its draft
    pays, is not captured. Whether code pays at a batch of two depends on this
    machine's step times (on one CI machine it did not, at a measured 1.04x overall); that decision against the cost model is
    the in-process test's (above), here it is what reaches /admin and /metrics."""
    import httpx

    from tide.prompts import Prompt, load_prompts, split

    from .conftest import WORKLOADS, serve_process
    from .test_registry_serving import metric

    args = ["--draft", str(trained_draft_dir), "--gamma", "auto", "--max-batch", "2", "--max-model-len", "512",
            "--admin-token", "t", "--capture", "*=auto"]  # fmt: skip
    with serve_process(args, tmp_path / "serve.log") as url, ThreadPoolExecutor(2) as pool:
        for name, workload, n, tokens in (("code.jsonl", "code", 4, 48), ("chat_fr.jsonl", "fr", 6, 64)):

            def ask(p: Prompt, workload: str = workload, tokens: int = tokens) -> None:
                body = {"model": "tide", "messages": p.messages, "max_tokens": tokens, "temperature": 0}
                r = httpx.post(
                    f"{url}/v1/chat/completions",
                    json=body,
                    headers={"X-Tide-Workload": workload},
                    timeout=120,
                )
                assert r.status_code == 200, r.text

            # two at a time, as many as the node batches: one workload after the other
            list(pool.map(ask, split(load_prompts(WORKLOADS / name), "test")[:n]))
        state = httpx.get(f"{url}/admin/controller", headers={"Authorization": "Bearer t"}).json()
        code, fr = state["workloads"]["code"], state["workloads"]["fr"]
        assert state["adaptive"] and not (code["speculation"] and code["capture"]), state
        # each workload's estimate has left the prior, from its own drafted steps. Which fits better
        # is the in-process test's question: once a workload is off, its estimate stands on a few
        # checks (code read 0.105 against French's 0.155 on one CI machine), too few to rank them
        assert PRIOR_ALPHA not in (code["alpha"][0], fr["alpha"][0]), state
        assert code["speculation"] or not fr["speculation"], state
        for w, d in (("code", code), ("fr", fr)):
            assert metric(url, "tide_workload_speculation", workload=w) == int(bool(d["speculation"]))
            assert metric(url, "tide_workload_capture", workload=w) == int(bool(d["capture"]))
        assert metric(url, "tide_speedup", kind="measured") > 0
        admin = {"Authorization": "Bearer t"}
        fixed = httpx.put(f"{url}/admin/speculation", json={"gamma": 2}, headers=admin).json()
        assert fixed == {"gamma": 2, "adaptive": False}
        back = httpx.put(f"{url}/admin/speculation", json={"adaptive": True}, headers=admin).json()
        assert back["adaptive"] is True


def test_step_times_are_measured_again_once_what_serves_changes() -> None:
    """A node may start without a draft, and compiles its layers in the background: the controller's
    step times, measured at the start, are measured again once a draft serves and the compile has
    ended, never while it runs, and again when a draft of another size replaces it (not for a new
    version of the same size); the gate's profile waits for the compile too."""
    target = tiny_target(seed=5, max_position=512)  # the gate's profile is timed at 256 positions
    engine = Engine(target, None, EngineConfig(max_batch=2, max_model_len=64, gamma=0, max_gamma=4))
    engine.use_controller(build_controller(target.model, None, ControllerConfig(max_gamma=4), 2, (1, 2), 32))
    controller = engine.controller
    assert controller is not None
    before = controller.costs
    assert [p.draft_step for p in before.profiles] == [0.0, 0.0]
    engine.refresh_costs()
    assert controller.costs is before  # nothing changed: nothing measured
    target.compiling = True
    engine.set_draft(tiny_draft(target))
    engine.swap_pending_drafts()
    engine.refresh_costs()
    assert controller.costs is before and engine.step_profile() is None
    target.compiling = False
    engine.refresh_costs()
    after = controller.costs
    assert [p.batch_size for p in after.profiles] == [1, 2], after.profiles
    assert all(p.draft_step > 0 for p in after.profiles), after.profiles
    assert engine.step_profile() is not None
    engine.set_draft(tiny_draft(target, seed=2))  # a new version, the same size
    engine.swap_pending_drafts()
    engine.refresh_costs()
    assert controller.costs is after
    engine.set_draft(tiny_draft(target, vocab=64))  # a smaller head
    engine.swap_pending_drafts()
    engine.refresh_costs()
    assert controller.costs is not after
    after = controller.costs
    engine.use_controller(controller, stale=True)  # measured while a compile ran
    engine.refresh_costs()
    assert controller.costs is not after
    now = controller.costs
    engine.use_controller(controller, stale=True)  # a busy node measures once stale for a while
    engine.refresh_costs(idle=False)
    assert controller.costs is now
    with mock.patch("tide.serving.engine.BUSY_REFRESH_S", 0.0):
        engine.refresh_costs(idle=False)
    assert controller.costs is not now
    now = controller.costs
    engine.use_controller(controller, stale=True)
    with mock.patch.object(controller, "measure_costs", side_effect=RuntimeError("a draft that raises")):
        engine.refresh_costs()  # logged, not raised: the engine's loop goes on, on the step times it had
    assert controller.costs is now
