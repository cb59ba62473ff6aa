"""`k3-amd-overlay bench plot` without matplotlib (a recording stand-in where a test draws): where
the PNG goes and that the path said is the path written, --out's usage errors before any plotting,
the input checked before matplotlib, and the install hint. Real matplotlib draws in
tests/engine/test_tools_extra.py."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from fifos import fifo_at, rescued

from k3_amd_overlay import json_files
from k3_amd_overlay.commands.bench import plot
from k3_amd_overlay.package import __version__

BENCH = {"device": "stand-in", "triton": "3.0", "results": [
    {"op": "rope_quant", "mode": "graph", "tokens": t, "fused_us": 2.0 * t, "baseline_us": 3.0 * t} for t in (1, 8)]}


class FakeMatplotlib:
    """matplotlib as plot() uses it: savefig writes its bytes at exactly the path it is given."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.matplotlib = types.ModuleType("matplotlib")
        self.matplotlib.use = lambda backend: self.calls.append(("use", backend))
        self.pyplot = types.ModuleType("matplotlib.pyplot")
        self.pyplot.subplots = self.subplots
        self.pyplot.close = lambda figure: self.calls.append(("close",))
        self.matplotlib.pyplot = self.pyplot

    def record(self, name: str) -> Any:
        return lambda *args, **kwargs: self.calls.append((name, *args))

    def subplots(self, nrows: int, ncols: int, **kwargs: Any) -> tuple[Any, list[list[Any]]]:
        self.calls.append(("subplots", nrows, ncols))
        figure = types.SimpleNamespace(suptitle=self.record("suptitle"), tight_layout=self.record("tight_layout"),
                                       savefig=lambda path, **kw: Path(path).write_bytes(b"png"))
        names = ("plot", "set_xscale", "set_yscale", "set_xlabel", "set_ylabel", "set_title", "legend")
        return figure, [[types.SimpleNamespace(**{n: self.record(n) for n in names}) for _ in range(ncols)]]


@pytest.fixture
def bench(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """plots/b.json under a fresh working directory."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plots").mkdir()
    path = Path("plots") / "b.json"
    path.write_text(json.dumps(BENCH))
    return path


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeMatplotlib:
    fake = FakeMatplotlib()
    monkeypatch.setitem(sys.modules, "matplotlib", fake.matplotlib)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", fake.pyplot)
    return fake


@pytest.fixture
def no_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)


def test_out_naming_a_directory_writes_the_input_stem_png_inside_it(bench, fake, tmp_path, capsys):
    assert plot.main([str(bench), "--out", "plots"]) == 0
    assert capsys.readouterr().out == f"{Path('plots') / 'b.png'}: 1 panels\n"
    assert (tmp_path / "plots" / "b.png").read_bytes() == b"png" and not (tmp_path / "plots.png").exists()


def test_out_in_a_missing_directory_is_a_usage_error_naming_out_before_any_plotting(bench, fake, tmp_path, capsys):
    missing = tmp_path / "nope" / "x.png"
    assert plot.main([str(bench), "--out", str(missing), "--json"]) == 2
    printed = capsys.readouterr()
    message = f"--out {missing}: no directory {missing.parent}"
    assert json.loads(printed.out)["usage_error"] == message
    assert printed.err.splitlines()[-1] == f"k3-amd-overlay bench plot: error: {message}"
    assert fake.calls == []


def test_out_under_a_file_is_a_usage_error_naming_out(bench, fake, capsys):
    assert plot.main([str(bench), "--out", str(bench / "x.png")]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"k3-amd-overlay bench plot: error: --out {bench / 'x.png'}: no directory {bench}")
    assert fake.calls == []


def test_out_that_is_not_a_png_or_is_the_input_is_a_usage_error(bench, fake, capsys):
    """The PNG is written whatever the suffix says: an .svg name would hold PNG bytes, the input's own
    name would lose the benchmark."""
    for out, why in ((bench.with_suffix(".svg"), "a PNG is written; name it .png (or give no suffix)"),
                     (bench, "a PNG is written; name it .png (or give no suffix)")):
        assert plot.main([str(bench), "--out", str(out)]) == 2
        assert capsys.readouterr().err.splitlines()[-1] == f"k3-amd-overlay bench plot: error: --out {out}: {why}"
    bare = bench.with_suffix("")  # an input without a suffix, given as its own --out
    bare.write_bytes(bench.read_bytes())
    assert plot.main([str(bare), "--out", str(bare)]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"k3-amd-overlay bench plot: error: --out {bare}: that is the input {bare}")
    assert fake.calls == []


@pytest.mark.usefixtures("no_matplotlib")
def test_a_missing_input_is_named_before_matplotlib_is_looked_for(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert plot.main(["nope.json"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("k3-amd-overlay bench plot: error: nope.json: ") and "matplotlib" not in err


@pytest.mark.usefixtures("no_matplotlib")
def test_without_matplotlib_the_hint_installs_matplotlib_or_the_wheels_extra(bench, capsys):
    assert plot.main([str(bench), "--json"]) == 1
    printed = capsys.readouterr()
    hint = ("matplotlib is not installed (pip install matplotlib, or the overlay's wheel with its plot extra: "
            f"pip install 'k3_amd_overlay-{__version__}-py3-none-any.whl[plot]')")
    assert printed.err == f"k3-amd-overlay bench plot: {hint}\n"
    assert json.loads(printed.out)["error"] == hint


@pytest.mark.parametrize("result,said", [
    ({"tokens": "8"}, "results[1] 'tokens' is '8', expected a whole number >= 1"),
    ({"tokens": 0}, "results[1] 'tokens' is 0, expected a whole number >= 1"),
    ({"fused_us": float("nan")}, "results[1] 'fused_us' is nan, expected a finite time in µs"),
    ({"baseline_us": "3.0"}, "results[1] 'baseline_us' is '3.0', expected a finite time in µs"),
    ({"heads": True}, "results[1] 'heads' is True, expected a whole number >= 1"),
    ({"op": 7}, "results[1] 'op' is 7, expected a name"),
])
def test_a_drawn_value_of_the_wrong_kind_is_named_with_its_result(bench, fake, capsys, result, said):
    """Before: ``invalid literal for int() with base 10: '8'`` with no field named, and a NaN drawn."""
    data = json.loads(bench.read_text())
    data["results"][1].update(result)
    bench.write_text(json.dumps(data))
    assert plot.main([str(bench)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(f"error: {bench}: {said}")
    assert not Path("plots/b.png").exists()


def test_results_that_are_no_list_of_objects_are_named(bench, fake, capsys):
    for results, said in (({"a": 1}, "'results' is an object, expected a list of results"),
                          ([1], "results[0] is 1, expected an object")):
        bench.write_text(json.dumps({**BENCH, "results": results}))
        assert plot.main([str(bench)]) == 2
        assert capsys.readouterr().err.strip().endswith(f"error: {bench}: {said}")


@pytest.mark.parametrize("data,kind", [([BENCH], "a list"), ("results", "a string"), (3, "a number"),
                                       (None, "null")])
def test_a_bench_json_that_is_no_object_says_what_bench_writes(bench, fake, capsys, data, kind):
    """Before, a list was "not what bench --json-out writes (list indices must be integers or slices,
    not str)": Python's words, and no word of what the file should hold."""
    bench.write_text(json.dumps(data))
    assert plot.main([str(bench), "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["usage_error"] == (
        f"{bench}: its JSON is {kind}, not what bench --json-out writes (an object whose 'results' is a list of "
        "measurements, each an object with 'op', 'mode', 'tokens' and times in µs such as 'fused_us')")
    assert fake.calls == []


def test_a_fifo_named_as_the_bench_json_is_refused_without_blocking(bench, fake, capsys):
    """Before, bench plot opened the FIFO and waited for a writer for ever (here: 3 s, then one comes,
    so that the old code fails this test rather than hanging it)."""
    with rescued(fifo_at(Path("plots") / "fifo.json"), 3.0) as fifo:
        code = plot.main([str(fifo), "--json"])
    assert code == 2
    assert json.loads(capsys.readouterr().out)["usage_error"] == f"{fifo}: {json_files.NOT_REGULAR}"
    assert fake.calls == []


# --- an existing file at --out; times of 0 or less; a panel with nothing to draw ------------------

def test_out_naming_an_existing_file_that_is_no_png_is_refused_and_kept(bench, fake, capsys):
    """Before, ``--out notes`` (no suffix, so allowed) replaced the notes with the plot."""
    notes = Path("notes")
    notes.write_text("my notes\n")
    assert plot.main([str(bench), "--out", str(notes), "--json"]) == 2
    printed = capsys.readouterr()
    message = f"--out {notes}: {notes} exists and is no PNG; it would be overwritten: name a new file (or remove it)"
    assert json.loads(printed.out)["usage_error"] == message
    assert printed.err.splitlines()[-1] == f"k3-amd-overlay bench plot: error: {message}"
    assert notes.read_text() == "my notes\n" and fake.calls == []


def test_the_default_png_beside_the_input_is_not_overwritten_where_it_is_no_png(bench, fake, capsys):
    beside = bench.with_suffix(".png")
    beside.write_text("not a picture")
    assert plot.main([str(bench)]) == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(f"{beside} exists and is no PNG; it would be "
                                                              "overwritten: name a new file (or remove it)")
    assert beside.read_text() == "not a picture"


def test_an_existing_png_is_replaced_and_stderr_says_so(bench, fake, capsys):
    png = Path("plots") / "old.png"
    png.write_bytes(plot.PNG_SIGNATURE + b"an earlier plot")
    assert plot.main([str(bench), "--out", str(png)]) == 0
    printed = capsys.readouterr()
    assert printed.err == f"k3-amd-overlay bench plot: replacing the PNG {png}\n"
    assert printed.out == f"{png}: 1 panels\n" and png.read_bytes() == b"png"


@pytest.mark.parametrize("value", [0, -2.5, 0.0])
def test_a_time_of_0_or_less_is_named_with_its_result(bench, fake, capsys, value):
    """A launch takes time, and the axis is logarithmic: before, such a point vanished from the plot."""
    data = json.loads(bench.read_text())
    data["results"][1]["fused_us"] = value
    bench.write_text(json.dumps(data))
    assert plot.main([str(bench)]) == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        f"error: {bench}: results[1] 'fused_us' is {value!r}, expected a time in µs more than 0")
    assert fake.calls == []


def test_an_op_with_no_time_to_draw_is_named_rather_than_drawn_empty(bench, fake, capsys):
    data = json.loads(bench.read_text())
    data["results"].append({"op": "mystery", "mode": "graph", "tokens": 4, "other_us": 1.0})
    bench.write_text(json.dumps(data))
    assert plot.main([str(bench)]) == 2
    keys = ", ".join(key for key, _ in plot.SERIES)
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        f"error: {bench}: op 'mystery' (1 graph result) has no time to draw: none of {keys}")
    assert fake.calls == []


def test_a_layer_step_is_drawn_from_its_stock_and_overlay_times(bench, fake, capsys):
    """What `bench` writes for its layer step (bench/layer_step.py): stock_us and overlay_us, and a
    verdict row without a mode, not drawn."""
    data = json.loads(bench.read_text())
    data["results"] += [{"op": "layer_step", "variant": "bf16", "heads": 12, "tokens": t, "mode": "graph",
                         "overlay_path": "norm pair + absorbed", "parity": "ok", "stock_us": 9.0 * t,
                         "overlay_us": 6.0 * t, "ratio": 1.5} for t in (1, 8)]
    data["results"].append({"op": "layer_step_target", "variant": "bf16", "goal": "x", "met": True})
    bench.write_text(json.dumps(data))
    assert plot.main([str(bench)]) == 0
    assert capsys.readouterr().out == f"{bench.with_suffix('.png')}: 2 panels\n"
    assert plot.panels(data["results"])["layer_step (12 heads)"] == {
        "overlay's layer step": [(1, 6.0), (8, 48.0)], "stock (vLLM's own launches)": [(1, 9.0), (8, 72.0)]}
