"""The runtime controller: gamma from the cost model and per-depth acceptance, off where it does not
pay (with exploration), the shift detector, and step times corrected by what serving measures."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import cast

import torch

from tests.conftest import tiny_draft, tiny_target, trained_tiny_draft
from tide.models.eagle3 import Eagle3Draft
from tide.models.loader import Target
from tide.registry.profile import StepProfile
from tide.serving.controller import Controller, ControllerConfig, alphas_from_taus, build_controller
from tide.serving.engine import Engine, EngineConfig
from tide.serving.sampling import SamplingParams

# CPU-like: verifying more tokens costs little more than decoding one, drafting is cheap
FLAT = StepProfile(1, {n: 0.020 + 0.0005 * (n - 1) for n in range(1, 10)}, 0.001)
# this machine at batch 1: a draft that misses costs more than its verify pass saves
CPU = StepProfile(1, {n: 0.016 + 0.0006 * (n - 1) for n in range(1, 10)}, 0.0015)
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


def test_off_where_it_does_not_pay_but_keeps_exploring() -> None:
    cfg = ControllerConfig(max_gamma=4, explore_every=8, explore_off_every=8, explore_far_every=8)
    c = Controller(cfg, [FLAT])
    feed(c, "fr", 0, 4, 300)  # nothing accepted
    picks = [c.choose(["fr"]) for _ in range(64)]
    assert sum(d.gamma for d in picks) == 8 and all(d.gamma in (0, 1) for d in picks)
    assert all(d.explore for d in picks if d.gamma)
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


def test_a_draft_swapped_back_takes_up_what_was_measured_of_it() -> None:
    c = Controller(ControllerConfig(max_gamma=4), [FLAT])
    c.draft_changed(["fr"], version="code")
    feed(c, "fr", 0, 4, 300)  # the code draft misses on French: off
    assert c.choose(["fr"]).gamma == 0
    c.draft_changed(["fr"], {1: 1.9, 2: 2.7}, version="mixed", replaced="code")
    assert c.choose(["fr"]).gamma >= 2
    # the new one fell short and the node rolled back: the code draft is still known to miss
    c.draft_changed(["fr"], None, version="code", replaced="mixed")
    assert c.choose(["fr"]).gamma == 0 and c.tracker("fr").seen[0] >= 300
    # long gone: the gate's measurement on recent traffic is the better guess
    c.cfg.remember_seconds = 0.0
    c.draft_changed(["fr"], {1: 1.9, 2: 2.7}, version="mixed", replaced="code")
    c.draft_changed(["fr"], {1: 1.9, 2: 2.7}, version="code", replaced="mixed")
    assert c.choose(["fr"]).gamma >= 2 and c.tracker("fr").seen[0] == 0


def test_shift_detector() -> None:
    c = Controller(ControllerConfig(max_gamma=4), [FLAT])
    feed(c, "w", 3, 4, 2000)
    assert not c.shifted("w")
    feed(c, "w", 1, 4, 60)  # one harder request is not a shift
    assert not c.shifted("w")
    feed(c, "w", 0, 4, 200)  # the traffic changed: the draft suddenly misses
    assert c.shifted("w")


def test_gamma_rides_out_a_harder_request_and_follows_a_shift() -> None:
    # acceptance swings from request to request: gamma follows the long average, not the short one
    c = Controller(ControllerConfig(max_gamma=6), [CPU])
    for i in range(2000):  # steady traffic: 0, 2 or all 6 drafts accepted in turn
        c.observe(["w"], torch.tensor([(0, 2, 6)[i % 3]]), 6, c.costs.step_time(1, 6))
    assert c.best(["w"]).gamma == 6
    feed(c, "w", 1, 6, 100)  # a request where only the first draft lands: not a shift
    assert not c.shifted("w") and c.best(["w"]).gamma == 6
    c.tracker("w").moved = c.tracker("w").shifted = True
    assert c.best(["w"]).gamma == 2  # what the short average alone would have chosen
    c.tracker("w").moved = c.tracker("w").shifted = False
    feed(c, "w", 0, 6, 30)  # the draft misses everything: the traffic changed, gamma follows at once
    assert c.shifted("w") and c.best(["w"]).gamma == 1


def test_gamma_follows_a_collapse_within_a_few_steps_and_comes_back() -> None:
    # a request where the draft misses everything: the shift detector takes about 50 steps to fire,
    # drafting six deep meanwhile; the very short average falls below half the long one in a dozen
    c = Controller(ControllerConfig(max_gamma=6), [CPU])
    for i in range(2000):
        c.observe(["w"], torch.tensor([(0, 2, 6)[i % 3]]), 6, c.costs.step_time(1, 6))
    feed(c, "w", 0, 6, 12)
    acc = c.tracker("w")
    assert not acc.shifted and acc.deciding(c.cfg) == "fell" and c.best(["w"]).gamma <= 2
    assert acc.deciding() == "long"  # without the rule: still six deep
    for i in range(30):  # the next request is as before
        c.observe(["w"], torch.tensor([(0, 2, 6)[i % 3]]), 6, c.costs.step_time(1, 6))
    assert acc.deciding(c.cfg) == "long" and c.best(["w"]).gamma == 6


def test_after_a_shift_deeper_depths_count_only_once_observed_again() -> None:
    """A draft that misses its first token rarely reaches the deeper depths, so their averages keep
    the old traffic's rates: gamma is chosen as if they were no better than the first depth's, until
    attempts there say otherwise."""
    c = Controller(ControllerConfig(max_gamma=6), [CPU])
    feed(c, "w", 6, 6, 2000)  # every draft accepted
    for i in range(400):  # the traffic changed: one step in four gets its first draft accepted
        c.observe(["w"], torch.tensor([1 if i % 4 == 0 else 0]), 1, c.costs.step_time(1, 1))
    acc = c.tracker("w")
    assert acc.shifted and acc.alphas("short")[2] > 0.9  # depth 3 last observed before the shift
    current = acc.alphas("short", current=True)
    assert current[2] == current[1] == current[0] < 0.3
    assert c.best(["w"]).gamma <= 1
    for i in range(400):  # the draft gets past its first token and then keeps going, observed at gamma 6
        c.observe(["w"], torch.tensor([6 if i % 3 == 0 else 0]), 6, c.costs.step_time(1, 6))
    assert min(acc.alphas("short", current=True)[1:]) > 0.9  # observed again: trusted again


def test_one_hard_request_does_not_call_for_training_and_a_shift_does() -> None:
    c = Controller(ControllerConfig(max_gamma=6), [CPU])
    for i in range(2000):  # steady traffic, as above
        c.observe(["w"], torch.tensor([(0, 2, 6)[i % 3]]), 6, c.costs.step_time(1, 6))
    feed(c, "w", 0, 6, 60)  # one request where nothing lands: the detector fires for a while
    assert c.shifted("w") and not c.needs_training("w")
    for i in range(200):  # and the next requests are as before
        c.observe(["w"], torch.tensor([(0, 2, 6)[i % 3]]), 6, c.costs.step_time(1, 6))
    assert not c.shifted("w") and not c.needs_training("w")
    for _ in range(500):  # the traffic changed for good: gamma falls, and the plain steps count too
        d = c.choose(["w"])
        c.observe(["w"], torch.tensor([0]), d.gamma, c.costs.step_time(1, d.gamma))
    assert c.best(["w"]).gamma == 0 and c.needs_training("w")


def steps_to_stop(cfg: ControllerConfig) -> int:
    c = Controller(cfg, [CPU])
    feed(c, "w", 3, 4, 2000)
    for n in range(1, 1000):
        if c.best(["w"]).gamma == 0:
            return n
        feed(c, "w", 0, c.best(["w"]).gamma, 1)
    return 1000


def test_after_a_shift_speculation_stops_within_a_few_dozen_steps() -> None:
    # the short average alone would take about a request (the horizon that keeps one hard request
    # from looking like a shift); once the detector fires, gamma follows the very short one
    assert (
        steps_to_stop(ControllerConfig(max_gamma=4))
        < 64
        < steps_to_stop(ControllerConfig(max_gamma=4, recent_steps=128))
    )


def test_speculation_comes_back_after_a_few_checks_when_the_draft_pays_again() -> None:
    c = Controller(ControllerConfig(max_gamma=4), [CPU])
    feed(c, "w", 3, 4, 2000)
    feed(c, "w", 0, 4, 300)  # off, far from paying: one token drafted in 128 steps
    steps = 0
    while not ((d := c.choose(["w"])).gamma and not d.explore) and steps < 1000:
        c.observe(["w"], torch.tensor([d.gamma]), d.gamma, c.costs.step_time(1, d.gamma))  # all accepted
        steps += 1
    assert steps <= 2 * ControllerConfig().explore_far_every, steps  # each check stands for the steps between


def drafted_after_lucky_checks(cfg: ControllerConfig, lucky: int) -> int:
    """Steps speculation ran (not checks) after `lucky` checks in a row found the draft right, on
    traffic where it is right once in 20 (the code draft on French)."""
    c = Controller(cfg, [CPU])
    feed(c, "w", 3, 4, 2000)
    for i in range(3000):  # the traffic moved: off, checking
        d = c.choose(["w"])
        c.observe(
            ["w"], torch.tensor([min(d.gamma, int(i % 20 == 0))]), d.gamma, c.costs.step_time(1, d.gamma)
        )
    assert not c.pays("w")
    drafted = checks = 0
    for _ in range(3 * cfg.explore_off_every * lucky):
        d = c.choose(["w"])
        checks += d.explore
        drafted += d.gamma > 0 and not d.explore
        ok = d.gamma if checks <= lucky else 0
        c.observe(["w"], torch.tensor([ok]), d.gamma, c.costs.step_time(1, d.gamma))
    return drafted


def test_a_few_lucky_checks_while_off_do_not_turn_speculation_on() -> None:
    # each check stands for the steps between (32): without doubting what it shows, one lucky check
    # lifted the first-depth rate from about 0.05 to 0.26 and turned speculation on for traffic it
    # does not pay on (two in a row, at one chance in 400, do turn it on)
    assert drafted_after_lucky_checks(ControllerConfig(max_gamma=4, resume_doubt=0.0), 1) > 0
    assert drafted_after_lucky_checks(ControllerConfig(max_gamma=4), 1) == 0


def test_a_shift_that_holds_resets_the_long_average() -> None:
    # off after a shift, the long average would learn the new rate from checks alone, a few
    # percent each: it kept code's rates for minutes and chose gamma on them once the detector let go
    c = Controller(ControllerConfig(max_gamma=4), [CPU])
    feed(c, "w", 3, 4, 2000)
    assert c.tracker("w").long[0] > 0.9
    for _ in range(600):
        d = c.choose(["w"])
        c.observe(["w"], torch.tensor([0]), d.gamma, c.costs.step_time(1, d.gamma))
    acc = c.tracker("w")
    assert c.needs_training("w") and acc.long[0] < 0.2 and not c.pays("w")


def test_step_times_are_corrected_by_measurements() -> None:
    c = Controller(ControllerConfig(max_gamma=4, cost_horizon=8), [FLAT])
    before = c.costs.step_time(1, 4)
    for _ in range(100):
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
        controller = Controller(ControllerConfig(max_gamma=6, explore_every=4), [profile])
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
    assert cast(list[float], code["alpha_long"])[0] >= cast(list[float], fr["alpha_long"])[0], snap
    assert not fr["speculation"], snap


def test_served_decisions_per_workload(trained_draft_dir: Path, tmp_path: Path) -> None:
    """`tide serve --gamma auto`: decisions per workload on /admin and /metrics alike. The draft fits
    code far better than French, and the node ranks them so: French is not speculated unless code is,
    and code, if its draft pays, is not captured. Whether code pays at a batch of two depends on this
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
        # the draft does not fit French (French α comes from the few exploring steps once it is off:
        # 0.0 to 0.19 in runs, code 0.34 to 0.48)
        assert fr["alpha_short"][0] < code["alpha_short"][0] - 0.1, state
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
