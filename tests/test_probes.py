"""bench/_probes.py: a probe that crashes, hangs or does not report success is a skip reason, not a crash."""

from __future__ import annotations

import textwrap

from conftest import bench_module


def test_probe_outcomes(tmp_path):
    probes = bench_module("_probes")
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent("""
        import sys, time
        mode = sys.argv[1]
        if mode == "ok":
            print("PROBE OK")
        elif mode == "crash":
            raise SystemExit("illegal memory access")
        elif mode == "silent":
            print("finished without the marker")
        else:
            time.sleep(60)
    """))
    jobs = [(("a",), ["ok"]), (("b",), ["crash"]), (("c",), ["silent"]), (("d",), ["hang"])]
    failed = probes.run_probes(script, jobs, timeout=5.0, cwd=tmp_path)
    assert set(failed) == {("b",), ("c",), ("d",)}
    assert "illegal memory access" in failed[("b",)] and "rc 1" in failed[("b",)]
    assert "rc 0" in failed[("c",)]
    assert "timed out" in failed[("d",)]
