"""scripts/device_bundle.py and scripts/device_call.sh: weights cut into chunks that travel
one per call come back together on the machine, checked by md5, and the calls run the
weight-free parts while the chunks arrive (a GPU machine's device time is short, so this is
checked here, with a small archive and no GPU)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import tarfile

import pytest

from conftest import REPO


@pytest.fixture(scope="module")
def bundle():
    spec = importlib.util.spec_from_file_location("device_bundle", REPO / "scripts" / "device_bundle.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def packed(bundle, tmp_path):
    """Two package folders (one with a cache, left out) packed and cut into three chunks."""
    for name in ("weights_a", "weights_b"):
        (tmp_path / "packages" / name / "data").mkdir(parents=True)
        (tmp_path / "packages" / name / "__init__.py").write_text("")
        (tmp_path / "packages" / name / "data" / "model.bin").write_bytes(os.urandom(3000))
    (tmp_path / "packages" / "weights_a" / "__pycache__").mkdir()
    archive = tmp_path / "weights.tar.xz"
    bundle.pack([tmp_path / "packages" / "weights_a", tmp_path / "packages" / "weights_b"], archive)
    with tarfile.open(archive) as tar:
        assert not any("__pycache__" in name for name in tar.getnames())
    size = archive.stat().st_size
    chunks = bundle.split(archive, tmp_path / "bundle", first=size // 4, rest=size // 2)
    assert [c.name for c in chunks] == ["w1", "w2", "w3"]
    assert sum(c.stat().st_size for f in chunks for c in f.glob("weights.tar.xz.*")) == size
    return chunks


def call(tmp_path, chunk, parts: str = "none") -> subprocess.CompletedProcess:
    """device_call.sh in a checkout that carried this chunk, as the machine would run it."""
    checkout = tmp_path / f"checkout-{chunk.name}"
    shutil.copytree(chunk, checkout / ".device" / chunk.name)
    out = tmp_path / f"out-{chunk.name}"
    out.mkdir()
    env = {**os.environ, "DEVICE_CHECK_HOME": str(tmp_path / "machine"), "OUT": str(out)}
    return subprocess.run(["bash", str(REPO / "scripts" / "device_call.sh"), parts], cwd=checkout, env=env,
                          capture_output=True, text=True)


def test_chunks_carried_one_per_call_are_unpacked_once_all_have_come(bundle, tmp_path):
    chunks = packed(bundle, tmp_path)
    (chunks[0] / "weights.tar.xz.07").write_bytes(b"a chunk of an earlier bundle")  # not read
    for i, chunk in enumerate(chunks, 1):
        done = call(tmp_path, chunk)
        assert done.returncode == 0, done.stderr
        assert (f"{i} of 3 chunks so far" in done.stdout) == (i < 3)
        assert (tmp_path / f"out-{chunk.name}" / "check.tgz").is_file()  # the report folder comes back each call
    site = tmp_path / "machine" / "site"
    for name in ("weights_a", "weights_b"):
        assert (site / name / "data" / "model.bin").read_bytes() == \
            (tmp_path / "packages" / name / "data" / "model.bin").read_bytes()
    assert "unpacked" in done.stdout


def test_a_damaged_chunk_fails_the_call_and_is_not_unpacked(bundle, tmp_path):
    chunks = packed(bundle, tmp_path)
    damaged = next(chunks[1].glob("weights.tar.xz.*"))
    damaged.write_bytes(bytes(b ^ 1 for b in damaged.read_bytes()))
    assert call(tmp_path, chunks[0]).returncode == 0
    assert call(tmp_path, chunks[1]).returncode == 0
    done = call(tmp_path, chunks[2])
    assert done.returncode != 0 and "damaged" in done.stderr and "carry them again" in done.stderr
    assert (tmp_path / f"out-{chunks[2].name}" / "check.tgz").is_file()  # the report still comes back
    assert not (tmp_path / "machine" / "weights.unpacked").exists()
    assert not (tmp_path / "machine" / "site" / "weights_a").exists()
    assert not any((tmp_path / "machine" / "chunks").iterdir())  # dropped, to be carried again


def test_the_plan_runs_the_dev_set_parts_as_soon_as_the_weights_have_come_within_the_device_time(bundle):
    plan = [line for line in bundle.calls(3).splitlines() if "bash scripts/device_call.sh" in line]
    assert plan[0].startswith('1. carry [".device/extras", ".device/w1"], timeout_s')
    assert plan[0].endswith("`bash scripts/device_call.sh none`") and plan[1].endswith("`bash scripts/device_call.sh none`")
    assert '[".device/w2"]' in plan[1] and '[".device/w3"]' in plan[2]
    assert plan[2].endswith("device_call.sh evaluate,tests,transcribe,stream --dtypes float16`")
    assert "benchmark --batch-sizes 1 " in plan[3] and "--lengths-attention" in plan[3] and plan[4].startswith("- carry nothing")
    numbered = [line for line in plan if line[0].isdigit()]
    timeouts = [int(line.split("timeout_s ")[1].split(":")[0]) for line in numbered]
    checks = [int(line.split("CHECK_SECONDS=")[1].split()[0]) if "CHECK_SECONDS=" in line else 0 for line in numbered]
    assert all(check < timeout <= 600 for check, timeout in zip(checks, timeouts))
    assert sum(timeouts) <= bundle.DEVICE_SECONDS - bundle.START_SECONDS  # the machine's start, too, is paid from it
    # whisper-base's weights and the extras with PyAV: four chunks, all within the device time too.
    four = [line for line in bundle.calls(4).splitlines() if line[:1].isdigit()]
    assert len(four) == 5 and sum(int(line.split("timeout_s ")[1].split(":")[0]) for line in four) <= (
        bundle.DEVICE_SECONDS - bundle.START_SECONDS)
    # One chunk: the dev-set parts come first.
    assert bundle.calls(1).splitlines()[4].startswith('1. carry [".device/extras", ".device/w1"]')
    assert "evaluate,tests" in bundle.calls(1).splitlines()[4]


def test_a_sound_archive_that_cannot_be_unpacked_keeps_its_chunks(tmp_path):
    """md5 right, unpacking failed (not the carried bytes' fault: /tmp full, say): the
    chunks stay for the next call, rather than having to be carried again."""
    chunk = tmp_path / "bundle" / "w1"
    chunk.mkdir(parents=True)
    data = b"not an xz archive"
    (chunk / "weights.tar.xz.01").write_bytes(data)
    (chunk / "weights.info").write_text(f"1 {hashlib.md5(data).hexdigest()}\n")
    done = call(tmp_path, chunk)
    assert done.returncode != 0 and "sound but could not be unpacked" in done.stderr
    assert (tmp_path / "machine" / "chunks" / "weights.tar.xz.01").is_file()
    assert not (tmp_path / "machine" / "weights.unpacked").exists()


def test_a_machine_without_the_weights_refuses_the_dev_set_parts_at_once(bundle, tmp_path):
    """A fresh machine (the chunk calls' one went back) would skip every dev-set part and
    lose the call's minutes: it says so and stops."""
    done = call(tmp_path, packed(bundle, tmp_path)[0], "evaluate,tests,transcribe,stream")
    assert done.returncode == 3 and "carry .device/extras and every .device/w* again" in done.stderr
    # The spare call's dev-set part too: it was run, skipped, and its minutes lost.
    again = tmp_path / "again"
    again.mkdir()
    assert call(again, packed(bundle, again)[0], "lengths-evaluate").returncode == 3


def test_the_report_shows_what_was_not_measured_and_is_mirrored_after_every_part(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    run = {"files": 3, "identical": 3, "wer_target": None, "wer_speculative": None, "wer_delta": None,
           "seconds_target": 0.5, "seconds_speculative": 0.0, "speedup": None, "decoder_speedup": None,
           "acceptance": None, "tokens_per_pass": None, "graphs": {}, "warm_up": None, "command": "asr.cli evaluate",
           "split": {"target-only": [0.01, 0.2, 0.25, 0.04]},
           "draft_length": "ours, speculative's adaptive draft length, over every round of the process: ..."}
    report = {"environment": {"GPU": "none"},
              "parts": {"evaluate float16": {"ok": True, "runs": {"manifest.tsv": run}, "part_seconds": 1.0}}}
    (tmp_path / "report").mkdir()
    monkeypatch.setenv("GPU_CHECK_MIRROR", str(tmp_path / "out" / "report"))
    check.write(report, tmp_path / "report")
    assert "| manifest.tsv | 3 | 3/3 | - | - | - | 0.50 | 0.00 | -x | -x | - | - |" in \
        (tmp_path / "out" / "report" / "gpu_check.md").read_text()
    written = (tmp_path / "report" / "gpu_check.md").read_text()
    assert "- manifest.tsv, target-only: 0.010, 0.200, 0.250, 0.040" in written
    assert "The adaptive draft length:\n\n- manifest.tsv: ours, speculative's adaptive draft length, over every" in written
    assert sorted(p.name for p in (tmp_path / "report").iterdir()) == ["gpu_check.json", "gpu_check.md"]


def test_every_dependency_of_the_project_is_packed_on_the_machine_or_unused_by_the_check(bundle):
    # PyAV was missing from the extras after MP3s moved to FFmpeg: the GPU machine failed the dev set.
    import re
    import tomllib

    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0].lower().replace("_", "-") for d in dependencies}
    weights = {name.replace("_", "-") for name in bundle.WEIGHTS}
    missing = names - set(bundle.EXTRAS) - set(bundle.ON_THE_MACHINE) - set(bundle.NOT_CHECKED) - weights
    assert not missing, f"dependencies the GPU machine would lack: {sorted(missing)}"
