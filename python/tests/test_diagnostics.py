"""gpudirect.doctor and gpudirect.explain_nccl_log from Python, on the
repository's fixtures: the same reports as the command, errors as the
package's exception classes."""

import json
import time
import os
import pathlib
import subprocess
import sys

import pytest

import gpudirect

REPO = pathlib.Path(__file__).resolve().parents[2]
CAPTURE = REPO / "tests/data/captures/dgx-pix.json"
LOGS = REPO / "tests/data/nccl-logs"


@pytest.fixture
def clean_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith("NCCL_") or k.startswith("UCX_"):
            monkeypatch.delenv(k)
    return monkeypatch


def test_doctor_judges_a_capture_and_the_environment_over_it(clean_env):
    r = gpudirect.doctor(from_capture=CAPTURE)
    assert r["schema"] == 1
    assert r["verdict"]["available"] is True
    assert r["verdict"]["line"] == "GPUDirect RDMA: available via dma-buf for GPU0 (NVIDIA H100, 0000:18:00.0) <-> mlx5_0 (PIX)"
    assert {f["check"] for f in r["findings"]} >= {"topology.devices", "cuda.driver", "pod.container", "nccl.nic.gpu0"}
    clean_env.setenv("NCCL_IB_DISABLE", "1")
    r = gpudirect.doctor(from_capture=str(CAPTURE))
    v = r["verdict"]
    assert v["available"] is False and v["hardware_allows"] is True
    assert v["line"].startswith("GPUDirect RDMA: the hardware allows it for GPU0"), v["line"]
    assert "NCCL_IB_DISABLE=1" in v["environment"]


def test_doctor_reads_a_job_script_without_running_it(clean_env, tmp_path):
    script = tmp_path / "job.sh"
    script.write_text("export NCCL_NET=Socket\npython train.py\n")
    r = gpudirect.doctor(from_capture=CAPTURE, env_file=script)
    f = next(f for f in r["findings"] if f["check"] == "env.nccl_net")
    assert f["status"] == "fail"
    assert f["evidence"][0].startswith(f"set by {script}")


def test_errors_are_the_packages_exceptions(clean_env, tmp_path):
    with pytest.raises(gpudirect.DoctorError) as e:
        gpudirect.doctor(from_capture=tmp_path / "missing.json")
    assert "missing.json" in str(e.value)
    assert isinstance(e.value, gpudirect.GpudirectError)
    with pytest.raises(gpudirect.DoctorError, match="at most one"):
        gpudirect.doctor(env_file="a", pid=1)
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": 99}')
    with pytest.raises(gpudirect.DoctorError, match="format"):
        gpudirect.doctor(from_capture=bad)


def test_a_capture_written_from_python_judges_the_same(clean_env, tmp_path):
    out = tmp_path / "again.json"
    first = gpudirect.doctor(from_capture=CAPTURE, capture=out)
    assert json.loads(out.read_text())["format"] == 1
    assert gpudirect.doctor(from_capture=out) == first


def test_explain_nccl_log_on_real_logs():
    r = gpudirect.explain_nccl_log((LOGS / "nccltests284-rtx4090-init-using-network-socket-2.25.1.txt").read_text())
    assert r["verdict"] == "not-used"
    # Two ranks, no nNodes line: what would happen between nodes, and its cost.
    assert r["headline"].startswith("GPUDirect RDMA would NOT be used between nodes: this log does not show whether the run spanned nodes")
    assert r["headline"].endswith("at about half the multi-node bandwidth")
    judged = {j["check"]: j for j in r["environment_judged"]}
    assert judged["env.nccl_ib_disable"]["status"] == "fail"
    r = gpudirect.explain_nccl_log((LOGS / "nccl-tests311-collnet-sharp-gdrdma.txt").read_text())
    assert r["verdict"] == "used"
    assert gpudirect.explain_nccl_log("not a log")["verdict"] == "unknown"


def test_python_dash_m_renders_as_the_command(clean_env):
    run = lambda *a: subprocess.run([sys.executable, "-m", "gpudirect", *a], capture_output=True, text=True)
    p = run("doctor", "--from", str(CAPTURE))
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[0].startswith("GPUDirect RDMA: available via dma-buf")
    p = run("nccl-log", str(LOGS / "nccltests284-rtx4090-init-using-network-socket-2.25.1.txt"))
    assert p.returncode == 1
    assert p.stdout.startswith("GPUDirect RDMA would NOT be used between nodes")
    p = run("doctor", "--from", "/nonexistent/c.json")
    assert p.returncode == 2 and "/nonexistent/c.json" in p.stderr
    p = run("nccl-log", "--json", str(LOGS / "nccl-tests311-collnet-sharp-gdrdma.txt"))
    assert json.loads(p.stdout)["verdict"] == "used"


def test_fleet_check_names_the_node_that_would_stage(clean_env, tmp_path):
    job = tmp_path / "job-9"
    job.mkdir()
    base = json.loads(CAPTURE.read_text())
    for n in ("n01", "n02", "n03"):
        (job / f"{n}.json").write_text(json.dumps(base))
    base["env"]["vars"].append(["NCCL_IB_DISABLE", "1"])
    base["env"]["origins"].append(["NCCL_IB_DISABLE", "rank environment"])
    (job / "n04.json").write_text(json.dumps(base))
    r = gpudirect.fleet_check(tmp_path, job="job-9", expect=5)
    assert r["nodes"] == 4 and r["missing"] == 1
    assert not r["available_everywhere"]
    assert [(g["folded"], g["checks"]) for g in r["staging"]] == [("n04", ["env.nccl_ib_disable"])]
    r = gpudirect.fleet_check(tmp_path, job="job-9", nodes="n[01-03,05]")
    assert r["missing_nodes"] == ["n05"] and r["unexpected"] == ["n04"]
    with pytest.raises(gpudirect.DoctorError, match="backwards"):
        gpudirect.fleet_check(tmp_path, job="job-9", nodes="n[05-01]")
    with pytest.raises(gpudirect.DoctorError):
        gpudirect.fleet_check(tmp_path, job="../x")


def test_fleet_check_refuses_what_the_command_refuses(clean_env, tmp_path):
    # The same checks as `gpudirect fleet check`, by the same code: once,
    # a wait with nothing to wait for was refused there and ignored here.
    (tmp_path / "job-9").mkdir()
    with pytest.raises(gpudirect.DoctorError, match="--wait needs --expect N or --nodes LIST"):
        gpudirect.fleet_check(tmp_path, job="job-9", wait=1.0)
    with pytest.raises(gpudirect.DoctorError, match="not both"):
        gpudirect.fleet_check(tmp_path, job="job-9", expect=2, nodes="n[1-2]")
    with pytest.raises(gpudirect.DoctorError, match="clock"):
        gpudirect.fleet_check(tmp_path, job="job-9", since=2**64 - 1)
    with pytest.raises(ValueError, match="wait -1"):
        gpudirect.fleet_check(tmp_path, job="job-9", expect=1, wait=-1.0)


def test_fleet_check_since_refuses_captures_from_before_the_job(clean_env, tmp_path):
    job = tmp_path / "job-9"
    job.mkdir()
    (job / "n01.json").write_text(CAPTURE.read_text())
    assert gpudirect.fleet_check(tmp_path, job="job-9", since=0)["nodes"] == 1
    r = gpudirect.fleet_check(tmp_path, job="job-9", since=int(time.time()) + 3600)
    assert not r["available_everywhere"], r


def test_fleet_check_reads_from_exactly_one_place(clean_env, tmp_path):
    for bad in ({}, {"dir": tmp_path, "rendezvous": "127.0.0.1:1"}):
        with pytest.raises(gpudirect.DoctorError, match="exactly one place"):
            gpudirect.fleet_check(job="j", **bad)
    with pytest.raises(gpudirect.DoctorError, match="job id"):
        gpudirect.fleet_check(rendezvous="127.0.0.1:1")
    # A rendezvous that never comes up: an error within the timeout.
    started = time.monotonic()
    with pytest.raises(gpudirect.DoctorError, match="127.0.0.1:1"):
        gpudirect.fleet_check(rendezvous="127.0.0.1:1", job="j", timeout=0.5)
    assert time.monotonic() - started < 5
