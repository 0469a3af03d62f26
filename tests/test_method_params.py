"""Parameters per arm, in the method text: ``snapkv[window=32]``, ``trimkv[gates=DIR]+global``,
``snapkv+adakv[alpha=0.3]`` (docs/methods.md, "The method text").

Parsing and the canonical text (hypothesis over parameter orders and spaces), the refusals
(field ``method``; one line and exit 2 through the console script), the comma split of list
options outside brackets, bracket parameters over routed ones, the cell keys of a grid of
today unchanged, and on a tiny model: ``snapkv[window=8]`` keeps what ``snapkv
--scorer-param window=8`` keeps, two arms of one scorer are two cells whose rows name their
parameters, and ``eval compare`` pairs them as methods."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cli_helpers import run_cli
from evictlab.cliutil import parse_list, split_outside_brackets
from evictlab.errors import InputError
from evictlab.methods import build_method, canonical_method, parse_method, parse_method_text

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the tiny-model fixture `tiny`: tests/conftest.py


# ---------------------------------------------------------------------------------- parsing


def test_parse_and_canonical_text() -> None:
    t = parse_method_text(" snapkv[ window = 32 , kernel=7]+adakv[alpha=0.3] ")
    assert (t.scorer, t.allocator) == ("snapkv", "adakv")
    assert t.scorer_params == (("kernel", "7"), ("window", "32")) and t.allocator_params == (("alpha", "0.3"),)
    assert t.text == "snapkv[kernel=7,window=32]+adakv[alpha=0.3]"
    assert t.scorer_text == "snapkv[kernel=7,window=32]" and t.allocator_text == "adakv[alpha=0.3]"
    assert parse_method("snapkv[window=32]+adakv") == ("snapkv", "adakv")
    assert canonical_method("snapkv[window=32]+uniform") == "snapkv[window=32]"
    assert canonical_method("snapkv+uniform") == "snapkv" and canonical_method("h2o") == "h2o"
    # a value may hold '+' and '/' (a path): the '+' inside brackets does not split the method
    t = parse_method_text("trimkv[gates=runs/a+b/local]+global")
    assert (t.scorer, t.allocator, t.scorer_params) == ("trimkv", "global", (("gates", "runs/a+b/local"),))
    assert canonical_method("snapkv+contourkv[ranking=query]") == "snapkv+contourkv[ranking=query]"


@settings(max_examples=60, deadline=None)
@given(order=st.permutations([("window", "16"), ("kernel", "3"), ("pooling", "max")]),
       spaces=st.lists(st.sampled_from(["", " ", "  "]), min_size=4, max_size=4), n=st.integers(1, 3))
def test_canonical_text_ignores_order_and_spaces(order, spaces, n) -> None:
    """Any order of a part's parameters, with spaces around keys and values: one text, sorted."""
    chosen = list(order)[:n]
    a, b, c, d = spaces
    text = "snapkv[" + ",".join(f"{a}{k}{b}={c}{v}{d}" for k, v in chosen) + "]+adakv[ alpha=0.2 ]"
    want = "snapkv[" + ",".join(f"{k}={v}" for k, v in sorted(chosen)) + "]+adakv[alpha=0.2]"
    assert canonical_method(text) == want
    assert build_method(text).spec == want


@pytest.mark.parametrize("bad, words", [
    ("snapkv[window=", "not closed"),
    ("snapkv[window=32", "not closed"),
    ("snapkv[window=32]x", "followed by other text"),
    ("snapkv]", "without its '['"),
    ("snapkv[]", "no parameters"),
    ("snapkv[=3]", "empty key"),
    ("snapkv[window=]", "empty value"),
    ("snapkv[window]", "no '='"),
    ("snapkv[foo=1]", "has no parameter 'foo'"),
    ("kvzip[x=1]", "has no parameter 'x'"),
    ("snapkv[window=4,window=8]", "given twice"),
    ("snapkv[a[b]=1]", "brackets inside"),
    ("snapkv+adakv[beta=1]", "has no parameter 'beta'"),
    ("nope[window=1]", "unknown scorer 'nope'"),
    ("snapkv+adakv+h2o", "more than one '+'"),
    ("snapkv[window=abc]", "is not int"),          # typed when built, still under method
    ("snapkv+adakv[alpha=2]", "outside [0, 1]"),   # the dataclass's own check, under method
])
def test_bad_method_texts_are_refused_under_method(bad: str, words: str) -> None:
    with pytest.raises(InputError) as err:
        build_method(bad)
    assert err.value.field == "method" and words in err.value.problem and err.value.fix
    assert "\n" not in str(err.value)


def test_bracket_parameters_override_routed_ones_for_that_arm_only() -> None:
    m = build_method("snapkv[window=8]+adakv", {"window": "4", "kernel": "3"}, {"alpha": "0.3"})
    assert m.spec == "snapkv[window=8]+adakv"
    assert m.scorer_params == {"window": 8, "kernel": 3} and m.scorer.window == 8 and m.allocator.alpha == 0.3
    assert m.record()["method"] == "snapkv[window=8]+adakv" and m.record()["scorer_params"]["window"] == 8
    assert build_method("snapkv", {"window": "4"}).scorer.window == 4
    # a routed parameter's bad value is still the routed option's
    with pytest.raises(InputError) as err:
        build_method("snapkv[window=8]", {"kernel": "x"})
    assert err.value.field == "scorer_param"
    # the label ORACLE's per-example labels keep the text
    lab = build_method("snapkv[window=8]").with_scorer_params(kernel=3)
    assert lab.spec == "snapkv[window=8]" and lab.scorer.window == 8


def test_list_options_split_on_commas_outside_brackets() -> None:
    assert split_outside_brackets("a[x=1,y=2],b", ",") == ["a[x=1,y=2]", "b"]
    assert parse_list("trimkv[gates=a]+global, snapkv[window=4,kernel=3],h2o", "--methods", "method") == [
        "trimkv[gates=a]+global", "snapkv[window=4,kernel=3]", "h2o"]
    assert parse_list(["snapkv[window=4,kernel=3]", "h2o,kvzip"], "--methods", "method") == [
        "snapkv[window=4,kernel=3]", "h2o", "kvzip"]
    with pytest.raises(InputError, match="empty entry"):
        parse_list("snapkv[window=4],", "--methods", "method")
    # an unclosed bracket keeps the rest in one entry, which the method parser refuses
    [entry] = parse_list("snapkv[window=4,h2o", "--methods", "method")
    with pytest.raises(InputError, match="not closed"):
        parse_method(entry)


# ---------------------------------------------------------------------------------- the grid


def _grid_of(argv: list[str]):
    import typer.main

    from evictlab import cli
    from evictlab.eval.commands import grid_of

    cmd = typer.main.get_command(cli.app).commands["eval"].commands["run"]
    with cmd.make_context("run", list(argv)) as ctx:
        return grid_of(ctx)


def _spec(**kw):
    from evictlab.eval.spec import GridSpec

    base = dict(models=["smollm2-135m"], tasks=["needle"], contexts=[160], budgets=["24"], n=1)
    base.update(kw)
    return GridSpec.build(**base)


def test_grid_methods_are_canonical_and_duplicates_refused() -> None:
    spec = _spec(methods=["snapkv[window=8, kernel=3]", "snapkv[window=4]", "snapkv"], scorer_params={"window": "16"})
    assert spec.evicting == ["snapkv[kernel=3,window=8]", "snapkv[window=4]", "snapkv"]
    cells = {c.method: c for c in spec.cells() if not c.is_full}
    assert cells["snapkv[kernel=3,window=8]"].scorer_params == (("kernel", "3"), ("window", "8"))
    assert cells["snapkv[window=4]"].scorer_params == (("window", "4"),)
    assert cells["snapkv"].scorer_params == (("window", "16"),)  # the routed value where no bracket says otherwise
    assert cells["snapkv[window=4]"].scorer == "snapkv[window=4]" and cells["snapkv"].scorer == "snapkv"
    with pytest.raises(InputError, match="repeated|twice|more than once") as err:
        _spec(methods=["snapkv[window=8,kernel=3]", "snapkv[kernel=3, window=8]"])
    assert err.value.field == "methods"
    with pytest.raises(InputError, match="the same arm") as err:
        _spec(methods=["snapkv", "snapkv[window=8]"], scorer_params={"window": "8"})
    assert err.value.field == "methods"
    with pytest.raises(InputError) as err:
        _spec(methods=["snapkv[window=x]"])
    assert err.value.field == "method"


def test_uniform_mode_of_a_bracketed_arm_keeps_the_scorer_parameters() -> None:
    spec = _spec(methods=["snapkv[window=8]+adakv[alpha=0.3]"], modes=["physical", "uniform"])
    phys, uni = [c for c in spec.cells() if not c.is_full]
    assert phys.allocator == "adakv[alpha=0.3]" and phys.allocator_params == (("alpha", "0.3"),)
    m = uni.decode_config().method
    assert m.spec == "snapkv[window=8]" and m.scorer.window == 8 and m.allocator_name == "uniform"


#: cell and unit keys of experiments/contourkv_scorers.toml computed at main's code before
#: bracket parameters existed (commit b7eb165): the grid running from main resumes unchanged
#: (the cells of the suite's tasks of then: facts_word joined the suite later, and its cells
#: are left out of the comparison)
SCORERS_KEYS = ("3b23f3ebb55cff59", "11313467755e03eb", 231,
                "smollm2-135m_needle_1024_expected_attention_physical_query-agnostic_128percell__0c41a79faf78",
                "gemma3-270m_keys_tagged_1024_compactor+contourkv_relerror_physical_query-agnostic_128percell__"
                "d0353948e5d0", "smollm2-135m_needle_1024_ex0__6b9ed80be5ba")
GATES_KEYS = ("ac2b316bcec8e672", "9230125671b52e67", 80,
              "smollm2-135m_needle_1024_trimkv+global_physical_query-agnostic_64percell__2e094d3e168f",
              "smollm2-135m_multi_key_1024_snapkv+contourkv_error_physical_query-agnostic_256percell__f6e34b1c99d6",
              "smollm2-135m_needle_1024_ex0__1ba82fdadee1")


@pytest.mark.parametrize("name, want", [("contourkv_scorers.toml", SCORERS_KEYS), ("gates.toml", GATES_KEYS)])
def test_cell_keys_of_a_grid_without_brackets_are_unchanged(name: str, want: tuple) -> None:
    spec, _, _ = _grid_of(["--config", str(ROOT / "experiments" / name)])
    keys = [c.key for c in spec.cells() if c.task != "facts_word"]
    units = [u.key for u in spec.units() if u.cells[0].task != "facts_word"]
    digest = lambda xs: hashlib.sha256("\n".join(xs).encode()).hexdigest()[:16]  # noqa: E731
    assert (digest(keys), digest(units), len(keys), keys[1], keys[-1], units[0]) == want


# ---------------------------------------------------------------------------------- the CLI


def test_decode_refuses_a_bad_method_text_in_one_line(tmp_path: Path, capsys, monkeypatch) -> None:
    code, _, err = run_cli(["decode", "--method", "snapkv[window=", "--out", str(tmp_path / "d.json")],
                           capsys, monkeypatch)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: --method: ") and "Fix:" in lines[0]


def test_eval_run_refuses_a_bad_method_text_in_one_line(tmp_path: Path, capsys, monkeypatch) -> None:
    for bad, words in (("snapkv[window=4,h2o", "not closed"), ("snapkv[foo=1],h2o", "no parameter 'foo'")):
        code, _, err = run_cli(["eval", "run", "--methods", bad, "--out", str(tmp_path / "g")], capsys, monkeypatch)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: --methods: "), err
        assert words in lines[0] and "Fix:" in lines[0]
    assert not (tmp_path / "g").exists()


def test_eval_run_splits_methods_outside_brackets() -> None:
    spec, _, _ = _grid_of(["--methods", "snapkv[window=4,kernel=3],snapkv+adakv[alpha=0.3],h2o", "--out", "x",
                           "--context", "160", "--budget", "24"])
    assert spec.evicting == ["snapkv[kernel=3,window=4]", "snapkv+adakv[alpha=0.3]", "h2o"]


def test_audit_and_sweep_refuse_one_method_twice_by_its_canonical_text() -> None:
    from evictlab.decode.audit import audit_configs
    from evictlab.dilution.sweep import SweepConfig
    from evictlab.kv.budget import Budget

    [(spec, cfg)] = audit_configs(["snapkv[ window=4 ]+adakv"], [Budget.parse("24")], modes=("physical",),
                                  allocator_params={"alpha": "0.3"})
    assert spec == "snapkv[window=4]+adakv" and cfg.method.scorer.window == 4 and cfg.method.allocator.alpha == 0.3
    with pytest.raises(InputError, match="twice|repeat"):
        audit_configs(["snapkv[window=4]", "snapkv[ window=4]"], [Budget.parse("24")])
    with pytest.raises(InputError, match="repeats a method") as err:
        SweepConfig(methods=("full", "snapkv[window=4]", "snapkv[window = 4]")).check()
    assert err.value.field == "--methods"
    with pytest.raises(InputError, match="not closed") as err:
        SweepConfig(methods=("snapkv[window=4",)).check()
    assert err.value.field == "--methods"


def test_claims_recognise_families_by_registry_name() -> None:
    from evictlab.eval.claims.common import family

    df = pl.DataFrame({"allocator": ["contourkv[ranking=query]", "adakv", None]})
    assert df.select(family("allocator"))["allocator"].to_list() == ["contourkv", "adakv", None]


# ---------------------------------------------------------------------------------- tiny model


def _tiny_spec(tiny: Path, **kw):
    from evictlab.eval.spec import LoopSettings

    loop = LoopSettings(sinks=2, recent=8, compress_every=8, window=16, block_size=8)
    return _spec(models=[str(tiny)], n=2, seed=3, loop=loop, **kw)


#: columns that may differ between two runs of the same arm under two spellings
NAMES = ["cell", "method", "scorer", "wall_s", "prefill_s"]


@pytest.fixture(scope="module")
def two_arms(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> pl.DataFrame:
    from evictlab.eval.grid import RESULTS, run_grid

    out = tmp_path_factory.mktemp("arms") / "g"
    run_grid(_tiny_spec(tiny, methods=["snapkv[window=4]", "snapkv[window=8]"]), out)
    return pl.read_parquet(out / RESULTS)


def test_a_bracketed_arm_keeps_what_the_routed_parameter_keeps(tiny: Path, tmp_path: Path, two_arms) -> None:
    """``snapkv[window=8]`` in a grid gives the rows of ``snapkv --scorer-param window=8``:
    the same kept entries (bytes, answers, logits) and the same effective parameters."""
    from evictlab.eval.grid import RESULTS, run_grid

    run_grid(_tiny_spec(tiny, methods=["snapkv"], scorer_params={"window": "8"}), tmp_path / "r")
    routed = pl.read_parquet(tmp_path / "r" / RESULTS).filter(pl.col("method") == "snapkv")
    inline = two_arms.filter(pl.col("method") == "snapkv[window=8]")
    assert routed.height == inline.height > 0
    assert set(inline["scorer"]) == {"snapkv[window=8]"} and set(routed["scorer"]) == {"snapkv"}
    assert set(inline["scorer_params"]) == set(routed["scorer_params"]) == {json.dumps({"window": "8"})}
    assert inline.drop(NAMES).equals(routed.drop(NAMES))


def test_two_arms_of_one_scorer_are_two_cells_paired_as_methods(two_arms, tmp_path: Path) -> None:
    from evictlab.eval.compare import compare, configurations

    arms = two_arms.filter(pl.col("method") != "full")
    params = dict(arms.select("method", "scorer_params").unique().iter_rows())
    assert params == {"snapkv[window=4]": json.dumps({"window": "4"}), "snapkv[window=8]": json.dumps({"window": "8"})}
    assert arms["cell"].n_unique() == 2
    pairs = compare(two_arms)
    m = pairs.filter(pl.col("kind") == "method")
    assert m.height == 1 and {m["a_method"][0], m["b_method"][0]} == {"snapkv[window=4]", "snapkv[window=8]"}
    assert {m["a_scorer"][0], m["b_scorer"][0]} == {"snapkv[window=4]", "snapkv[window=8]"}
    conf = configurations(pairs).filter(pl.col("kind") == "method")
    assert {conf["a"][0], conf["b"][0]} == {"snapkv[window=4]", "snapkv[window=8]"}  # not pooled: two scorers
