"""``bench --json-out FILE``, on a CPU: a FILE the measurements could not be written to (under a
missing directory, a directory itself) is a usage error before anything is benchmarked, naming the
path, with --json one object on stdout; a write refused after all the measuring is a reason, not a
traceback."""

from __future__ import annotations

import json

import pytest
import torch

from k3_amd_overlay.commands.bench import kernels


@pytest.fixture
def never_benchmarked(monkeypatch):
    """A GPU as far as bench can tell; any benchmark started fails the test."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: pytest.fail("benchmarked before --json-out was checked"))


@pytest.mark.parametrize("where,why", [
    ("nodir/x.json", "the directory {tmp}/nodir does not exist (bench creates none)"),
    (".", "a directory; name a file (e.g. {tmp}/bench.json)"),
], ids=["missing-directory", "a-directory"])
@pytest.mark.parametrize("as_json", [True, False], ids=["json", "text"])
def test_a_json_out_that_cannot_be_written_is_a_usage_error_before_benchmarking(
        never_benchmarked, tmp_path, capsys, where, why, as_json):
    path = tmp_path / where if where != "." else tmp_path
    code = kernels.main(["--json-out", str(path), "--quick", *(["--json"] if as_json else [])])
    out, err = capsys.readouterr()
    said = f"--json-out {path}: {why.format(tmp=tmp_path)}"
    assert code == 2 and f"k3-amd-overlay bench: error: {said}" in err and "Traceback" not in err
    if as_json:
        data = json.loads(out)
        assert data["exit_status"] == 2 and data["ok"] is False and data["usage_error"] == said
    else:
        assert out == ""


def test_the_legacy_json_file_form_is_checked_too(never_benchmarked, tmp_path, capsys):
    path = tmp_path / "nodir" / "x.json"
    assert kernels.main(["--json", str(path)]) == 2
    assert f"--json-out {path}: the directory {tmp_path / 'nodir'} does not exist" in capsys.readouterr().err


def test_a_write_refused_after_measuring_is_said_not_raised(tmp_path):
    """(The path may change while bench measures: run then fails with this reason, its measurements
    still in the --json object.)"""
    gone = tmp_path / "gone"
    measured = {"device": "NVIDIA H200", "results": [{"op": "qk_cache", "fused_us": 3.0}]}
    why = kernels.write_json_out(str(gone / "x.json"), measured)
    assert why is not None and why.startswith(f"--json-out {gone / 'x.json'}: cannot write it (")
    assert kernels.write_json_out(str(tmp_path / "x.json"), {**measured, "error": "e"}) is None
    assert json.loads((tmp_path / "x.json").read_text()) == measured
