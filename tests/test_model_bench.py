"""bench/model.py's interleaved timing (``--interleave``), on the CPU with stand-in steps and timers."""

import pytest
from conftest import bench_module
from hypothesis import given
from strategies import seeds


def _module():
    return bench_module("model")


class _Clock:
    """A clock that advances 1 ms per step run (so warmup_ms counts steps)."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _steps(log, clock, ms):
    def make(name):
        def switch():
            log.append(("switch", name))

            def step():
                log.append(("step", name))
                clock.t += 1e-3
            return step
        return switch
    return {name: make(name) for name in ms}


def test_rounds_alternate_and_warmup_comes_first():
    M = _module()
    log, clock = [], _Clock()
    ms = {"sdpa": [10.0, 11.0, 12.0, 13.0], "safeops": [20.0, 21.0, 22.0, 23.0]}
    blocks = []

    def time_block(step, n):
        name = log[-1][1]
        blocks.append((name, n))
        start = sum(k for b, k in blocks[:-1] if b == name)
        return ms[name][start:start + n]

    out = M.interleaved_ms(_steps(log, clock, ms), rounds=2, per_round=2, warmup_ms=3, time_block=time_block,
                           clock=clock)
    # Warmup: each implementation switched to and run for 3 ms (3 steps) before any timing.
    assert log[:8] == [("switch", "sdpa")] + [("step", "sdpa")] * 3 + [("switch", "safeops")] + [
        ("step", "safeops")] * 3
    # Rounds: sdpa then safeops, then the reverse order; one untimed step after each switch.
    assert blocks == [("sdpa", 2), ("safeops", 2), ("safeops", 2), ("sdpa", 2)]
    switches = [name for kind, name in log[8:] if kind == "switch"]
    assert switches == ["sdpa", "safeops", "safeops", "sdpa"]
    # Medians and 20th / 80th percentiles over all rounds' samples (linear between ranks).
    assert out["sdpa"] == pytest.approx((11.5, 10.6, 12.4))
    assert out["safeops"] == pytest.approx((21.5, 20.6, 22.4))


def test_quantile_is_exact_on_ranks_and_linear_between():
    M = _module()
    values = [1.0, 2.0, 4.0, 8.0, 16.0]
    assert M.quantile(values, 0.0) == 1.0 and M.quantile(values, 1.0) == 16.0
    assert M.quantile(values, 0.5) == 4.0
    assert M.quantile(values, 0.125) == pytest.approx(1.5)
    assert M.quantile([7.0], 0.8) == 7.0


@given(seed=seeds())
def test_grads_repeatable_tells_identical_from_changed_gradients(seed):
    """``grads_repeatable`` is True for a step that gives the same gradient bits twice, False when one
    parameter's gradient changes in its last bit between the steps, and checks parameters without one."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    model[1].bias.requires_grad_(False)  # a parameter that never gets a gradient
    x = seed.randn(16, 8)
    calls = []

    def step():
        model.zero_grad(set_to_none=True)
        model(x).square().sum().backward()
        calls.append(1)

    assert _module().grads_repeatable(model, step)
    assert len(calls) == 2

    def drifting():
        step()
        if len(calls) % 2 == 0:  # the second step of a pair: one element one ulp away
            g = model[0].weight.grad
            g.view(-1)[3] = torch.nextafter(g.view(-1)[3], torch.tensor(float("inf")))

    assert not _module().grads_repeatable(model, drifting)


def test_cuda_graph_refuses_interleave_before_any_work(capsys):
    """``--cuda-graph`` times each implementation's replays; combined with ``--interleave`` it must stop at
    argument parsing (an argparse error), before touching a GPU or building a model."""
    M = _module()
    with pytest.raises(SystemExit) as e:
        M.main(["--cuda-graph", "--interleave", "2"])
    assert e.value.code == 2 and "--cuda-graph" in capsys.readouterr().err
