"""Problem files in every format become the same records; a bad row fails naming its file and row; real sets
load with their known counts."""

import json
import sys
import types
from pathlib import Path

import pytest

from r3jax.data import problems as rp

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def write(path, rows):
    """Writes rows as a JSON array (.json), JSON lines (.jsonl) or parquet (.parquet); returns the path."""
    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow
        import pyarrow.parquet

        pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), path)
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def content(problem_set):
    return [(p.uid, p.problem, p.answers) for p in problem_set]


USER_PROMPT = [{"role": "system", "content": "Think."}, {"role": "user", "content": "What is 2+3?"}]

SHAPES = {  # id: (row, expected problem text, expected answers)
    "aime_leading_zero": ({"problem": "Q", "answer": "025"}, "Q", ("025",)),
    "amc_integral_float": ({"problem": "Q", "answer": 142.0}, "Q", ("142",)),
    "fractional_float": ({"problem": "Q", "answer": 0.25}, "Q", ("0.25",)),
    "int": ({"problem": "Q", "answer": 7}, "Q", ("7",)),
    "minerva_list_with_newlines": ({"problem": "Q", "answer": ["9.6\n", "9.60\n"]}, "Q", ("9.6", "9.60")),
    "olympiad_dollar_wrapped": ({"problem": "Q", "answer": ["$2^{1009}$"]}, "Q", ("2^{1009}",)),
    "two_math_spans_kept": ({"problem": "Q", "answer": ["$69$,$84$"]}, "Q", ("$69$,$84$",)),
    "escaped_dollar_kept": ({"problem": "Q", "answer": " \\$ 5 "}, "Q", ("\\$ 5",)),
    "repeated_answers_once": ({"problem": "Q", "answer": ["1", " 1"]}, "Q", ("1",)),
    "gsm8k_solution": ({"problem": "Q", "answer": None, "solution": "2 + 2 = 4\n#### 1,234"}, "Q", ("1234",)),
    "gsm8k_hub_answer": ({"question": "Q", "answer": "So 70 + 2 = 72\n#### 72"}, "Q", ("72",)),
    "question_field": ({"question": " Q\n", "answer": "3"}, "Q", ("3",)),
    "extra_info_question": ({"extra_info": {"question": "Q"}, "reward_model": {"ground_truth": "5"}}, "Q", ("5",)),
    "chat_prompt": ({"prompt": USER_PROMPT, "reward_model": {"ground_truth": "5"}}, "What is 2+3?", ("5",)),
    "gt_answer": ({"prompt": USER_PROMPT, "gt_answer": "5"}, "What is 2+3?", ("5",)),
}


@pytest.mark.parametrize("row, problem, answers", SHAPES.values(), ids=SHAPES.keys())
def test_row_schema_maps_to_problem_and_answers(row, problem, answers):
    p = rp.row_to_problem(row, "test")
    assert (p.problem, p.answers) == (problem, answers)


@pytest.mark.parametrize("name", ["set.json", "set.jsonl", "set.parquet"])
def test_every_format_gives_the_same_problems(tmp_path, name):
    rows = [{"problem": f"Question {i}?", "answer": str(i)} for i in range(5)]
    expected = [(rp.problem_uid(r["problem"]), r["problem"], (r["answer"],)) for r in rows]
    problem_set = rp.load_problems(write(tmp_path / name, rows))
    assert content(problem_set) == expected
    assert {p.source for p in problem_set} == {"set"}


def test_json_file_may_hold_json_lines(tmp_path):
    path = tmp_path / "lines.json"
    path.write_text('{"problem": "A", "answer": "1"}\n\n{"problem": "B", "answer": "2"}\n')
    assert [p.problem for p in rp.load_problems(path)] == ["A", "B"]


def test_json_lines_split_on_newlines_only(tmp_path):
    """U+2028 is legal raw inside a JSON string; CRLF line ends are fine too."""
    path = tmp_path / "lines.jsonl"
    path.write_text('{"problem": "A\u2028B", "answer": "1"}\r\n{"problem": "C", "answer": "2"}\r\n', encoding="utf-8")
    assert [p.problem for p in rp.load_problems(path)] == ["A\u2028B", "C"]


def test_source_defaults_to_file_stem_and_can_be_given(tmp_path):
    path = write(tmp_path / "amc23.jsonl", [{"problem": "A", "answer": "1"}])
    assert rp.load_problems(path)[0].source == "amc23"
    assert rp.load_problems(path, source="AMC 2023")[0].source == "AMC 2023"


MALFORMED = {  # id: (row, what the error says)
    "not_an_object": (["Q", "1"], r"expected an object, got list"),
    "no_problem": ({"answer": "1"}, r"no problem text"),
    "empty_problem": ({"problem": "  ", "answer": "1"}, r"problem text is empty"),
    "problem_not_string": ({"problem": 3, "answer": "1"}, r"problem text must be a string, got int"),
    "no_answer": ({"problem": "Q"}, r"no answer"),
    "null_answer": ({"problem": "Q", "answer": None}, r"answer is null"),
    "empty_answer": ({"problem": "Q", "answer": " "}, r"answer is empty"),
    "empty_answer_list": ({"problem": "Q", "answer": []}, r"answer is an empty list"),
    "bool_answer": ({"problem": "Q", "answer": True}, r"answer must be a string or number, got bool"),
    "object_in_answer_list": ({"problem": "Q", "answer": ["1", {}]}, r"answer\[1\] must be a string or number"),
    "prompt_not_messages": ({"prompt": "Q", "answer": "1"}, r"prompt must be a list of \{role, content\}"),
    "prompt_without_user": ({"prompt": USER_PROMPT[:1], "answer": "1"}, r"prompt has no message with role 'user'"),
    "empty_ground_truth": ({"prompt": USER_PROMPT, "reward_model": {"ground_truth": ""}},
                           r"reward_model\.ground_truth is empty"),
}


@pytest.mark.parametrize("row, reason", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_row_error_names_file_and_row(tmp_path, row, reason):
    path = write(tmp_path / "bad_rows.jsonl", [{"problem": "fine", "answer": "1"}, row])
    with pytest.raises(rp.DataError, match=rf"bad_rows\.jsonl: line 2: {reason}"):
        rp.load_problems(path)


def test_data_error_is_a_value_error():
    assert issubclass(rp.DataError, ValueError)


def test_skip_mode_reports_each_skipped_row(tmp_path):
    rows = [{"problem": "A", "answer": "1"}, {"problem": "B"}, {"problem": "C", "answer": "3"}, 7]
    problem_set = rp.load_problems(write(tmp_path / "mixed.json", rows), on_error="skip")
    assert [p.problem for p in problem_set] == ["A", "C"]
    report = problem_set.report
    assert (report.rows, report.kept) == (4, 2)
    assert [(Path(s.file).name, s.row) for s in report.skipped] == [("mixed.json", 1), ("mixed.json", 3)]
    assert "no answer" in report.skipped[0].reason


def test_file_with_no_problems_is_an_error(tmp_path):
    with pytest.raises(rp.DataError, match=r"empty\.jsonl: no problems"):
        rp.load_problems(write(tmp_path / "empty.jsonl", []))
    with pytest.raises(rp.DataError, match=r"all_bad\.jsonl: no problems .* line 1: no answer"):
        rp.load_problems(write(tmp_path / "all_bad.jsonl", [{"problem": "Q"}]), on_error="skip")


BROKEN_FILES = {  # id: (file name, bytes, what the error says)
    "json_array": ("broken.json", b'[{"problem": "A", "answer": "1"},', r"broken\.json: not valid JSON"),
    "jsonl_line": ("broken.jsonl", b'{"problem": "A", "answer": "1"}\n\n{"problem": "B",\n',
                   r"broken\.jsonl: line 3: not valid JSON"),
    "json_lines_in_json": ("broken.json", b'{"problem": "A", "answer": "1"}\n{oops}\n',
                           r"broken\.json: line 2: not valid JSON"),
    "not_utf8": ("latin.jsonl", '{"problem": "caf\xe9", "answer": "1"}'.encode("latin-1"),
                 r"latin\.jsonl: not UTF-8"),
    "parquet": ("broken.parquet", b"PAR1 this is not parquet", r"broken\.parquet: not a readable parquet file"),
    "unknown_suffix": ("set.csv", b"problem,answer\nA,1\n", r"set\.csv: unknown problem file type '\.csv'"),
}


@pytest.mark.parametrize("name, data, message", BROKEN_FILES.values(), ids=BROKEN_FILES.keys())
def test_unreadable_file_error_names_the_file(tmp_path, name, data, message):
    (tmp_path / name).write_bytes(data)
    with pytest.raises(rp.DataError, match=message):
        rp.load_problems(tmp_path / name)


def test_missing_file_is_not_taken_for_a_hub_id(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"missing\.json"):
        rp.load_problems(tmp_path / "missing.json")
    with pytest.raises(FileNotFoundError, match=r"owner/name\.jsonl"):
        rp.load_problems("owner/name.jsonl")


def test_parquet_without_pyarrow_says_what_to_install(tmp_path, monkeypatch):
    path = write(tmp_path / "set.parquet", [{"problem": "A", "answer": "1"}])
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(ImportError, match=r"set\.parquet needs pyarrow: pip install pyarrow"):
        rp.load_problems(path)


@pytest.mark.parametrize("kwargs, message", [({"on_error": "ignore"}, "on_error"), ({"limit": 0}, "limit")])
def test_bad_arguments(tmp_path, kwargs, message):
    path = write(tmp_path / "set.jsonl", [{"problem": "A", "answer": "1"}])
    with pytest.raises(ValueError, match=message):
        rp.load_problems(path, **kwargs)


def test_uid_ignores_file_order_source_and_whitespace(tmp_path):
    rows = [{"problem": "What is  1+1?\n", "answer": "2"}, {"problem": "Name a prime.", "answer": "2"}]
    forward = rp.load_problems(write(tmp_path / "a.jsonl", rows))
    backward = rp.load_problems(write(tmp_path / "b.parquet", rows[::-1]))
    assert [p.uid for p in forward] == [p.uid for p in backward][::-1]
    assert forward[0].uid == rp.problem_uid("What is 1+1?") == backward.problems[1].uid
    assert len(forward[0].uid) == 16 and int(forward[0].uid, 16) >= 0


def test_duplicates_in_one_file_are_merged_and_reported(tmp_path):
    rows = [{"problem": "A  b", "answer": "1"}, {"problem": "C", "answer": "3"},
            {"problem": "A\nb", "answer": ["1", "one"]}]
    problem_set = rp.load_problems(write(tmp_path / "dups.jsonl", rows))
    assert [(p.problem, p.answers) for p in problem_set] == [("A  b", ("1", "one")), ("C", ("3",))]
    assert (problem_set.report.rows, problem_set.report.kept) == (3, 2)
    [duplicate] = problem_set.report.duplicates
    assert duplicate.row == 2 and "dups[0]" in duplicate.reason and "added answers ['one']" in duplicate.reason


def test_index_of_is_the_position():
    problem_set = rp.ProblemSet(tuple(rp.Problem(rp.problem_uid(q), q, ("1",), "s") for q in "ABC"))
    assert [problem_set.index_of(p.uid) for p in problem_set] == [0, 1, 2]
    assert problem_set[1].problem == "B" and len(problem_set) == 3
    with pytest.raises(KeyError, match="no problem with uid"):
        problem_set.index_of("0" * 16)


def test_problem_set_rejects_repeated_uids():
    p = rp.Problem(rp.problem_uid("A"), "A", ("1",), "s")
    with pytest.raises(ValueError, match="share uid"):
        rp.ProblemSet((p, p))


def test_merge_dedupes_across_sets_keeping_first_source_and_all_answers(tmp_path):
    train = rp.load_problems(write(tmp_path / "train.jsonl", [{"problem": "A", "answer": "1"},
                                                              {"problem": "B", "answer": "2"}]))
    extra = rp.load_problems(write(tmp_path / "extra.json", [{"problem": "C", "answer": "3"},
                                                             {"problem": "B", "answer": "two"}]))
    merged = rp.merge(train, extra)
    assert [(p.problem, p.answers, p.source) for p in merged] == [
        ("A", ("1",), "train"), ("B", ("2", "two"), "train"), ("C", ("3",), "extra")]
    assert (merged.report.rows, merged.report.kept) == (4, 3)
    assert [(d.file, d.row) for d in merged.report.duplicates] == [("extra", 1)]


def test_limit_keeps_the_first_distinct_problems(tmp_path):
    rows = [{"problem": q, "answer": "1"} for q in "AABCD"]
    problem_set = rp.load_problems(write(tmp_path / "set.jsonl", rows), limit=2)
    assert [p.problem for p in problem_set] == ["A", "B"]
    assert (problem_set.report.rows, len(problem_set.report.duplicates)) == (3, 1)


HUB_ID = "agentica-org/DeepScaleR-Preview-Dataset"


def fake_datasets(load_dataset):
    module = types.ModuleType("datasets")
    module.load_dataset = load_dataset
    return module


def test_hub_id_loads_through_datasets(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    calls = []

    def load_dataset(dataset_id, split):
        calls.append((dataset_id, split))
        return [{"problem": "Q", "answer": "4", "solution": "2+2"}]

    monkeypatch.setitem(sys.modules, "datasets", fake_datasets(load_dataset))
    problem_set = rp.load_problems(HUB_ID)
    assert calls == [(HUB_ID, "train")]
    assert (problem_set[0].problem, problem_set[0].answers, problem_set[0].source) == ("Q", ("4",), HUB_ID)


def test_hub_without_datasets_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match=r'pip install "r3jax\[hub\]"'):
        rp.load_problems(HUB_ID)


def test_hub_offline_error_names_the_id(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)

    def load_dataset(dataset_id, split):
        raise ConnectionError("Couldn't reach the Hugging Face Hub")

    monkeypatch.setitem(sys.modules, "datasets", fake_datasets(load_dataset))
    with pytest.raises(rp.DataError, match=rf"could not load '{HUB_ID}' \(split 'test'\).*offline"):
        rp.load_problems(HUB_ID, split="test")


# file: (rows read, problems kept, malformed rows skipped, duplicates merged), measured with on_error="skip".
REAL_COUNTS = {
    "rllm/test/aime.json": (30, 30, 0, 0),
    "rllm/test/amc.json": (83, 83, 0, 0),
    "rllm/test/math.json": (500, 500, 0, 0),
    "rllm/test/minerva.json": (272, 272, 0, 0),
    "rllm/test/olympiad_bench.json": (675, 675, 0, 0),
    "rllm/test/gsm8k.json": (1319, 1319, 0, 0),
    "rllm/train/aime.json": (975, 975, 0, 0),
    # rows 886 and 1009 have a null answer, 5328 and 5330 an empty one (multiple choice); 957 repeats 923
    "rllm/train/math.json": (7474, 7469, 4, 1),
    "simpletir/aime25.jsonl": (30, 30, 0, 0),
    "simpletir/aime25.parquet": (30, 30, 0, 0),
    # rows 5054 and 5158 have an empty ground truth (MATH train's 5328 and 5330); 4007 repeats 1769,
    # 4465 repeats 4237 up to whitespace
    "simpletir/simplelr_math_35_train.parquet": (8523, 8519, 2, 2),
}


@pytest.fixture(scope="module")
def real():
    """Loads each real file once per module (on_error="skip"); skips when ../shared/data is absent."""
    if not DATA.is_dir():
        pytest.skip(f"no shared data folder at {DATA}")
    cache = {}

    def load(name):
        if name not in cache:
            cache[name] = rp.load_problems(DATA / name, on_error="skip")
        return cache[name]

    return load


@pytest.mark.parametrize("name", REAL_COUNTS)
def test_real_set_counts(real, name):
    report = real(name).report
    assert (report.rows, report.kept, len(report.skipped), len(report.duplicates)) == REAL_COUNTS[name]


def test_real_malformed_row_raises_by_default(real):
    with pytest.raises(rp.DataError, match=r"math\.json: row 886: answer is null"):
        rp.load_problems(DATA / "rllm/train/math.json")


def test_real_math_train_skips_exactly_the_answerless_rows(real):
    skipped = real("rllm/train/math.json").report.skipped
    assert [(s.row, s.reason.split(" (")[0]) for s in skipped] == [
        (886, "answer is null"), (1009, "answer is null"), (5328, "answer is empty"), (5330, "answer is empty")]


def test_real_aime25_jsonl_and_parquet_agree(real):
    assert content(real("simpletir/aime25.jsonl")) == content(real("simpletir/aime25.parquet"))


def test_real_answer_shapes(real):
    assert real("rllm/test/aime.json")[1].answers == ("025",)
    assert real("rllm/test/amc.json")[0].answers == ("142",)
    assert real("rllm/test/minerva.json")[10].answers == ("0.01", "0.02")
    assert real("rllm/test/olympiad_bench.json")[2].answers == ("2^{1009}",)
    assert real("rllm/test/gsm8k.json")[0].answers == ("18",)
    assert real("simpletir/aime25.parquet")[0].answers == ("70",)


def test_real_no_answer_keeps_a_newline_or_a_math_wrapper(real):
    for name in ("rllm/test/minerva.json", "rllm/test/olympiad_bench.json"):
        for p in real(name):
            assert all(a == a.strip() and not (a[0] == a[-1] == "$" and a.count("$") == 2) for a in p.answers), p


def test_real_overlaps_between_sets(real):
    """Not failures, facts to know: the DeepScaleR-style pool (train AIME + MATH train) repeats 288 AIME
    problems, and 3 MATH-500 test problems are train-AIME problems."""
    train_aime, train_math = real("rllm/train/aime.json"), real("rllm/train/math.json")
    pool = rp.merge(train_aime, train_math)
    across = len(pool.report.duplicates) - len(train_math.report.duplicates)
    assert (len(pool), across) == (8156, 288)
    math500 = {p.uid for p in real("rllm/test/math.json")}
    assert len(math500 & {p.uid for p in train_aime}) == 3
    assert not math500 & {p.uid for p in train_math}
    assert not {p.uid for p in real("rllm/test/aime.json")} & {p.uid for p in train_aime}


def test_skip_mode_skips_lines_that_are_not_json_and_a_bom_is_not_data(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_bytes('\ufeff{"problem": "A", "answer": "1"}\n{not json\n{"problem": "B", "answer": "2"}\n'.encode())
    loaded = rp.load_problems(path, on_error="skip")
    assert [p.problem for p in loaded] == ["A", "B"]
    assert [(i.row, i.line, i.reason.split(" (")[0]) for i in loaded.report.skipped] == [(1, 2, "not valid JSON")]
