"""The mutmut runs that continue earlier work (mutation/mutmut_cache.py, mutmut_run.py): an
interrupted run resumes under its key, and a run whose only change is test files added to a
module's list starts from the finished run, keeps its kills and checks its other mutants with
the added files alone; each on a small tree and fake runs, no mutmut started.
"""

from __future__ import annotations

import json

import pytest

from raggedspec.conformance.test_mutation_shards import _meta, _tree
from raggedspec.mutation import mutmut_cache, runner
from raggedspec.mutation.scope import MUTMUT_MODULES


@pytest.mark.rule("mutation scope, shards, result cache and CI plan")
def test_only_added_test_files_let_a_run_continue_from_a_finished_one(tmp_path, monkeypatch):
    root, cache, m = _tree(tmp_path), tmp_path / "cache", "reference/rope.py"
    old_tests = ("conformance/test_rope.py",)
    new_tests = old_tests + ("conformance/test_rope_more.py",)
    (root / "conformance" / "test_rope_more.py").write_text("def test_h():\n    pass\n")

    def parts(tests=new_tests):
        return mutmut_cache.module_parts(root, m, tests, "3.8.1")

    done = tmp_path / "ws" / "mutants"
    _meta(done, m, {"raggedspec.reference.rope.x_f__mutmut_1": 1})
    k0 = mutmut_cache.key_of(parts(old_tests))
    assert k0 == mutmut_cache.module_key(root, m, old_tests, "3.8.1")
    mutmut_cache.store(cache, m, k0, done, 3.0)  # an entry without its parts: never a base
    assert mutmut_cache.base_for(cache, m, parts()) is None
    mutmut_cache.store(cache, m, k0, done, 3.0, parts(old_tests))
    seed, key, added = mutmut_cache.base_for(cache, m, parts())
    assert key == k0 and (seed / "raggedspec" / (m + ".meta")).is_file()
    assert added == ["conformance/test_rope_more.py"]
    assert mutmut_cache.base_for(cache, m, parts(old_tests)) is None  # that is a plain hit
    assert mutmut_cache.base_for(cache, m, parts(("conformance/test_rope_more.py",))) is None
    for path, text in [(root / m, "def f(x):\n    return x + 2\n"),
                       (root / "conformance" / "test_rope.py", "def test_f():\n    assert 1\n"),
                       (root / "conformance" / "conftest.py", "# other profiles\n"),
                       (root / "conformance" / "helpers.py", "# a new helper\n")]:
        before = path.read_text() if path.is_file() else None
        path.write_text(text)
        assert mutmut_cache.base_for(cache, m, parts()) is None, path
        if before is None:
            path.unlink()
        else:
            path.write_text(before)
    assert mutmut_cache.base_for(cache, m, parts()) is not None
    assert mutmut_cache.base_for(cache, m, mutmut_cache.module_parts(
        root, m, new_tests, "3.9.0")) is None


@pytest.mark.rule("mutation scope, shards, result cache and CI plan")
def test_seeding_keeps_kills_and_timeouts_and_reopens_every_other_verdict(tmp_path):
    m = "reference/rope.py"
    seed, ws = tmp_path / "seed", tmp_path / "ws"
    names = [f"raggedspec.reference.rope.x_f__mutmut_{i}" for i in range(1, 7)]
    _meta(seed, m, dict(zip(names, [1, 0, 36, 33, None, 3], strict=True)))
    assert runner.seed_mutants(ws, m, seed, reopen=False) == 1
    assert runner.seed_mutants(ws, m, seed, reopen=True) == 3
    codes = json.loads((ws / "raggedspec" / (m + ".meta")).read_text())["exit_code_by_key"]
    assert codes == dict(zip(names, [1, None, 36, None, None, 3], strict=True))


@pytest.mark.rule("mutation scope, shards, result cache and CI plan")
def test_the_added_tests_alone_decide_the_reopened_mutants_and_the_rest_keep_their_verdict(
        tmp_path):
    m = "reference/rope.py"
    seed, ws = tmp_path / "seed", tmp_path / "ws"
    names = [f"raggedspec.reference.rope.x_f__mutmut_{i}" for i in range(1, 6)]
    # killed, survived, no tests, survived, timeout
    _meta(seed, m, dict(zip(names, [1, 0, 33, 0, 36], strict=True)))
    old = runner.reopened_codes(seed, m)
    assert old == {names[1]: 0, names[2]: 33, names[3]: 0}
    runner.seed_mutants(ws, m, seed, reopen=True)
    # the added file kills mutant 2, covers nothing of mutant 3, lets mutant 4 live
    _meta(ws, m, dict(zip(names, [1, 1, 33, 0, 36], strict=True)))
    runner.settle_reopened(ws, m, old)
    codes = json.loads((ws / "raggedspec" / (m + ".meta")).read_text())["exit_code_by_key"]
    assert codes == dict(zip(names, [1, 1, 33, 0, 36], strict=True))
    _meta(ws, m, dict(zip(names, [1, None, 5, 0, 36], strict=True)))  # unreached, no tests
    runner.settle_reopened(ws, m, old)
    codes = json.loads((ws / "raggedspec" / (m + ".meta")).read_text())["exit_code_by_key"]
    assert codes == dict(zip(names, [1, 0, 33, 0, 36], strict=True))
    _meta(ws, m, dict(zip(names, [1, -24, 36, 0, 36], strict=True)))  # reopened ones time out
    runner.settle_reopened(ws, m, old)
    codes = json.loads((ws / "raggedspec" / (m + ".meta")).read_text())["exit_code_by_key"]
    assert codes == dict(zip(names, [1, 0, 33, 0, 36], strict=True))  # the old timeout stays


@pytest.mark.rule("mutation scope, shards, result cache and CI plan")
def test_a_continued_run_gives_its_mutants_a_larger_cpu_time_floor_in_its_copy_only(tmp_path):
    from raggedspec.mutation import mutmut_run
    (tmp_path / "pyproject.toml").write_text(
        '[tool.mutmut]\nonly_mutate = ["x"]\ntimeout_constant = 0.5\n')
    mutmut_run._set_mutmut_config(tmp_path, ["raggedspec/reference/rope.py"], None)
    assert "timeout_constant = 0.5\n" in (tmp_path / "pyproject.toml").read_text()
    mutmut_run._set_mutmut_config(tmp_path, ["raggedspec/reference/rope.py"], None,
                                  mutmut_run.CONTINUATION_TIMEOUT_CONSTANT)
    text = (tmp_path / "pyproject.toml").read_text()
    assert f"timeout_constant = {mutmut_run.CONTINUATION_TIMEOUT_CONSTANT}\n" in text
    assert mutmut_run.CONTINUATION_TIMEOUT_CONSTANT > 0.5
    assert 'only_mutate = ["raggedspec/reference/rope.py"]' in text


@pytest.mark.rule("mutation scope, shards, result cache and CI plan")
def test_an_interrupted_run_is_resumed_and_added_tests_reopen_only_the_survivors(
        tmp_path, monkeypatch):
    root, cache, m = _tree(tmp_path), tmp_path / "cache", "reference/rope.py"
    monkeypatch.setitem(MUTMUT_MODULES, m, ("conformance/test_rope.py",))
    calls = []

    def fake_run(module, root_, jobs, log, timeout, seed=None, reopen=False, only=None):
        calls.append((seed, reopen, only))
        ws = tmp_path / f"ws{len(calls)}" / "mutants"
        codes = {f"raggedspec.reference.rope.x_f__mutmut_{i}": 1 for i in (1, 2)}
        if len(calls) == 1:
            _meta(ws, module, {**codes, "raggedspec.reference.rope.x_f__mutmut_2": None})
            raise runner.RunInterrupted("past the limit", ws, 40.0)
        _meta(ws, module, codes)
        got = runner.read_mutants_dir(ws).modules[module]
        got.seconds = 5.0
        return got, [], ws

    monkeypatch.setattr("raggedspec.mutation.mutmut_run.run_module", fake_run)
    monkeypatch.setattr("raggedspec.mutation.mutmut_run.drop_workspace", lambda ws: None)
    with pytest.raises(runner.RunInterrupted, match="kept"):
        runner.run_modules([m], root, 1, cache, log=lambda *_: None)
    key = runner.module_key(root, m)
    assert calls == [(None, False, None)]
    got, _ = runner.run_modules([m], root, 1, cache, log=lambda *_: None)
    assert calls[1] == (mutmut_cache.partial_dir(cache, m, key) / "mutants", False, None)
    assert got.modules[m].seconds == 45.0 and got.modules[m].base == ""
    assert not mutmut_cache.partial_dir(cache, m, key).exists()  # done: the partial is gone
    (root / "conformance" / "test_rope_more.py").write_text("def test_h():\n    pass\n")
    monkeypatch.setitem(MUTMUT_MODULES, m, ("conformance/test_rope.py",
                                            "conformance/test_rope_more.py"))
    third, _ = runner.run_modules([m], root, 1, cache, log=lambda *_: None)
    assert calls[2] == (mutmut_cache.entry_dir(cache, m, key) / "mutants", True,
                        ["conformance/test_rope_more.py"])
    assert third.modules[m].base == key and third.modules[m].seconds == 45.0 + 5.0
    again, _ = runner.run_modules([m], root, 1, cache, log=lambda *_: None)
    assert len(calls) == 3 and again.modules[m].reused and again.modules[m].base == key
