"""Tasks: determinism, disjoint splits, exact rewards (expected values by hand), a user dataset's
formats, layouts, graders and errors."""

import json
from fractions import Fraction

import pytest

from harness.base.models import CHAR_ALPHABET
from harness.base.registry import build
from harness.tasks import TASKS
from harness.tasks.arithmetic import arithmetic_trace, place_parts
from harness.tasks.countdown import ExprError, countdown_reward, parse_expression
from harness.tasks.graders import extract_answer, last_boxed, last_number


def task(name, **kw):
    return build(TASKS, name, "task", **kw)


def test_registry_names_and_kwarg_check():
    assert set(TASKS) == {"arithmetic", "countdown", "hf", "word_problems"}
    with pytest.raises(TypeError, match="digit"):
        task("arithmetic", digit=3)


@pytest.mark.parametrize("name", ["arithmetic", "countdown"])
def test_sampling_is_deterministic_and_splits_are_disjoint(name):
    t = task(name)
    a, b = t.sample(50, "train", seed=3), t.sample(50, "train", seed=3)
    assert a == b and a != t.sample(50, "train", seed=4)
    train = {t.key(p) for s in range(4) for p in t.sample(500, "train", seed=s)}
    held = {t.key(p) for s in range(4) for p in t.sample(200, "eval", seed=s)}
    assert len(held) > 50 and not train & held
    with pytest.raises(ValueError, match="valid: train, eval"):
        t.sample(1, "test")


@pytest.mark.parametrize("name", ["arithmetic", "countdown"])
def test_text_uses_the_char_alphabet_and_solutions_earn_reward(name):
    t = task(name)
    for p in t.sample(200, "train", seed=0) + t.sample(50, "eval", seed=0):
        assert set(p.prompt + p.answer + p.solution) <= set(CHAR_ALPHABET)
        assert t.reward(p, p.solution) == 1.0
        assert len(p.solution) + 1 <= t.max_new_tokens


def test_place_parts_and_traces_by_hand():
    assert place_parts(405) == [400, 5] and place_parts(0) == [0] and place_parts(70) == [70]
    assert arithmetic_trace(47, "+", 85) == "47+80+5=127+5=132"
    assert arithmetic_trace(85, "-", 47) == "85-40-7=45-7=38"
    assert arithmetic_trace(12, "-", 47) == "12-40-7=-28-7=-35"
    assert arithmetic_trace(23, "*", 45) == "23*40+23*5=920+115=1035"
    assert arithmetic_trace(23, "*", 5) == "23*5=115"
    # 167*324 = 50100 + 3340 + 668 = 53440 + 668 = 54108
    assert arithmetic_trace(167, "*", 324) == (
        "167*300+167*20+167*4=50100+3340+668=53440+668=54108"
    )


def test_arithmetic_difficulty_and_reward():
    t = task("arithmetic", digits=3, ops="-")
    for p in t.sample(100, "train", seed=0):
        a, b = p.prompt[:-1].split("-")
        assert len(a) == len(b) == 3 and int(a) - int(b) == int(p.answer)
    p = task("arithmetic").sample(1, "train", seed=0)[0]
    assert t.reward(p, f"x={p.answer} ") == 1.0
    assert t.reward(p, f"{p.answer}") == 0.0  # no '=': no final answer
    assert t.reward(p, f"={p.answer}0") == 0.0
    with pytest.raises(ValueError, match="ops"):
        task("arithmetic", ops="+/")


def test_parse_expression_precedence_and_exactness():
    assert parse_expression("2+3*4") == (14, [2, 3, 4])
    assert parse_expression("(2+3)*4")[0] == 20
    assert parse_expression("8/4/2")[0] == 1 and parse_expression("7-2-1")[0] == 4
    assert parse_expression("8/3*6")[0] == 16 and parse_expression("1/3")[0] == Fraction(1, 3)
    for bad in ["", "2+", "(2+3", "2+3)", "2**3", "-2+3", "__import__('os')", "2/(1-1)"]:
        with pytest.raises(ExprError):
            parse_expression(bad)


@pytest.mark.parametrize(
    "response, expected",
    [
        ("3*7+9", 1.0),  # 21 + 9 = 30, each number once
        ("9+7*3", 1.0),  # precedence: 9 + 21
        ("3*7+9=30", 1.0),  # '= target' suffix ignored
        ("let me think\n(3*7)+9\n", 1.0),  # the last non-empty line is graded
        ("3*9+3", 0.0),  # 3 used twice (given once)
        ("21+9", 0.0),  # 21 not given
        ("3*7", 0.0),  # 21 != 30 (using a subset is allowed, but wrong value)
        ("3*7+9+0", 0.0),  # 0 not given
        ("3*(7+9", 0.0),  # unbalanced
        ("__import__('os').system('x')", 0.0),
        ("", 0.0),
    ],
)
def test_countdown_reward(response, expected):
    assert countdown_reward([3, 7, 9], 30, response) == expected


def test_countdown_reward_exact_division_and_zero():
    assert countdown_reward([8, 3, 6], 16, "8/3*6") == 1.0  # exact rational 16
    assert countdown_reward([5, 5, 2], 2, "2/(5-5)") == 0.0
    assert countdown_reward([5, 5, 2], 2, "2*(5/5)") == 1.0  # duplicates count: 5 given twice


def test_countdown_problems_respect_their_bounds():
    t = task("countdown", n_numbers=4, max_number=6, max_target=50)
    for p in t.sample(100, "train", seed=1):
        nums = p.info["numbers"]
        assert len(nums) == 4 and all(1 <= n <= 6 for n in nums)
        assert (
            1 <= int(p.answer) <= 50
            and p.prompt == f"make {p.answer} from " + " ".join(map(str, nums)) + ":"
        )


def test_answer_extraction():
    assert last_number("a 1,234 b -5.5 c") == "-5.5" and last_number("none") is None
    assert last_boxed(r"x \boxed{\frac{1}{2}} y") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{1} \boxed{2") is None
    assert extract_answer("48/2 = 24 clips.\n#### 72") == "72"
    assert extract_answer(r"so \boxed{3} and 4") == "3"
    assert extract_answer("it is 1,000 apples") == "1000"


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


GSM = [
    {"question": f"Q{i}: what is {i}+{i}?", "answer": f"{i}+{i} = {2 * i}\n#### {2 * i:,}"}
    for i in range(1000, 1040)
]


def test_hf_gsm8k_jsonl_with_the_last_number_grader(tmp_path):
    t = task("hf", path=str(write_jsonl(tmp_path / "d.jsonl", GSM)), grader="last_number")
    train, held = t.splits["train"], t.splits["eval"]
    assert len(train) == 36 and len(held) == 4  # round(0.1 · 40) by prompt hash
    assert not {p.prompt for p in train} & {p.prompt for p in held}
    p = next(q for q in train + held if q.prompt.startswith("Q1000:"))
    assert p.answer == "2000" and p.solution == "1000+1000 = 2000\n#### 2,000"
    assert t.reward(p, "The answer is 2,000.") == 1.0
    assert t.reward(p, "2000.0") == 1.0
    assert t.reward(p, r"\boxed{2000} (not 7)") == 1.0  # \boxed{} wins over the last number
    assert t.reward(p, r"\boxed{1999} so 2000") == 0.0
    assert t.reward(p, "no number") == 0.0
    assert t.sample(10, "train", seed=1) == t.sample(10, "train", seed=1)
    assert len(t.sample(100, "train", seed=0)) == 100  # cycles through a small split
    with pytest.warns(UserWarning, match=r"eval_n=100 exceeds the eval split \(4 problems\)"):
        assert sorted(t.sample(100, "eval", seed=0), key=str) == sorted(held, key=str)


def test_a_small_file_still_splits_and_the_split_ignores_row_order(tmp_path):
    a = task("hf", path=str(write_jsonl(tmp_path / "a.jsonl", GSM[:3])))
    b = task("hf", path=str(write_jsonl(tmp_path / "b.jsonl", GSM[:3][::-1])))
    assert (len(a.splits["train"]), len(a.splits["eval"])) == (2, 1)  # never an empty eval split
    assert a.splits == b.splits
    with pytest.raises(ValueError, match=r"1 problem; a train and an eval split need >= 2"):
        task("hf", path=str(write_jsonl(tmp_path / "c.jsonl", GSM[:1])))


MATH_VERIFY_CASES = [  # (reference answer field, response, reward) worked by hand
    (r"so \boxed{\frac{1}{2}}", "The answer is 0.5", 1.0),  # LaTeX fraction vs decimal
    (r"\boxed{0.5}", r"we get \boxed{\frac{1}{2}}", 1.0),
    ("#### 1000", "1,000", 1.0),  # thousands separator
    (r"\boxed{12}", r"\boxed{12\text{ cm}}", 1.0),  # a unit in the response
    (r"\boxed{2\sqrt{2}}", r"$\sqrt{8}$", 1.0),  # LaTeX vs LaTeX, equal values
    (r"\boxed{\frac{1}{2}}", r"\boxed{\frac{1}{3}}", 0.0),  # wrong
    (r"\boxed{7}", "I do not know", 0.0),  # nothing parses
]


@pytest.mark.parametrize("ref, response, reward", MATH_VERIFY_CASES)
def test_math_verify_grades_equal_values_in_other_forms(tmp_path, ref, response, reward):
    rows = [{"question": "q", "answer": ref}, {"question": "r", "answer": "#### 1"}]
    t = task("hf", path=str(write_jsonl(tmp_path / "d.jsonl", rows)), eval_frac=0.5)
    p = next(q for q in t.splits["train"] + t.splits["eval"] if q.prompt == "q")
    assert t.reward(p, response) == reward


def test_hf_parquet_math_layout_and_eval_path(tmp_path):
    pd = pytest.importorskip("pandas")
    rows = [{"problem": f"p{i}", "solution": rf"so \boxed{{\frac{{{i}}}{{2}}}}"} for i in range(5)]
    pd.DataFrame(rows).to_parquet(tmp_path / "train.parquet")
    pd.DataFrame(rows[:2]).to_parquet(tmp_path / "test.parquet")
    t = task(
        "hf",
        path=str(tmp_path / "train.parquet"),
        eval_path=str(tmp_path / "test.parquet"),
        layout="math",
    )
    assert len(t.splits["train"]) == 5 and [p.prompt for p in t.splits["eval"]] == ["p0", "p1"]
    p = t.splits["eval"][1]
    assert p.answer == r"\frac{1}{2}" and t.reward(p, "0.5") == 1.0


def test_hf_dapo_layout_from_a_save_to_disk_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [
        {
            "prompt": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": f"What is {i} + {i}?"},
            ],
            "reward_model": {"ground_truth": str(2 * i), "style": "rule"},
        }
        for i in range(4)
    ]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "dapo"))
    t = task("hf", path=str(tmp_path / "dapo"), layout="dapo", eval_frac=0.25)
    p = next(q for q in t.splits["train"] + t.splits["eval"] if q.prompt == "What is 3 + 3?")
    assert p.answer == "6" and t.reward(p, r"\boxed{6}") == 1.0 and t.reward(p, "5") == 0.0


@pytest.mark.parametrize(
    "bad, message",
    [
        ('{"question": "q"}', r"d\.jsonl:2: no field 'answer' \(it has \['question'\]\)"),
        ("{not json", r"d\.jsonl:2: not valid JSON"),
        ("[1, 2]", r"d\.jsonl:2: expected a JSON object, got list"),
        ('{"question": "q", "answer": "none"}', r"d\.jsonl:2: no reference answer in field"),
    ],
)
def test_a_malformed_row_names_file_line_and_field(tmp_path, bad, message):
    path = write_jsonl(tmp_path / "d.jsonl", [GSM[0], bad, GSM[1]])
    with pytest.raises(ValueError, match=message):
        task("hf", path=str(path))


@pytest.mark.parametrize(
    "kw, message",
    [
        (
            {"path": "no/such/dataset"},
            r"task.path='no/such/dataset': not a file or folder here, "
            "and not a dataset in the local HF cache",
        ),
        ({"layout": "gsm9k"}, r"task.layout='gsm9k'; valid: gsm8k, math, dapo"),
        ({"grader": "exact"}, r"task.grader='exact'; valid: math_verify, last_number"),
        ({"eval_frac": 1.0}, r"task.eval_frac=1.0; valid: 0 < eval_frac < 1"),
    ],
)
def test_bad_dataset_settings_name_key_value_and_what_is_valid(tmp_path, kw, message):
    kw = {"path": str(write_jsonl(tmp_path / "d.jsonl", GSM[:4])), **kw}
    with pytest.raises(ValueError, match=message):
        task("hf", **kw)


def test_rollout_rewards_match_rows_to_their_prompts_and_drop_masked_text():
    """Rows follow `prompt_index`; tokens after the response mask (here a wrong '=<answer>' tail)
    do not count. Expected rewards by hand: [1, 0, 1, 0]."""
    import torch

    from harness.base.models import char_tokenizer
    from harness.sampling.rollout import Rollout

    tok, t = char_tokenizer(), task("arithmetic")
    p0, p1 = t.sample(2, "train", seed=0)
    texts = [  # (prompt index, response text, characters inside the response mask)
        (0, p0.solution, len(p0.solution)),  # right
        (0, p1.solution, len(p1.solution)),  # p1's solution answering p0: wrong
        (1, p1.solution + "=" + p0.answer, len(p1.solution)),  # right: the wrong tail is masked
        (1, "=" + p0.answer + "=" + p1.answer, len(p0.answer) + 1),  # wrong: the right tail is
    ]
    ids = [tok(s, add_special_tokens=False).input_ids for _, s, _ in texts]
    T = max(map(len, ids))
    resp = torch.full((4, T), tok.pad_token_id)
    mask = torch.zeros(4, T)
    for r, (x, (_, _, keep)) in enumerate(zip(ids, texts)):
        resp[r, : len(x)] = torch.tensor(x)
        mask[r, :keep] = 1
    z = torch.zeros(4, T)
    ro = Rollout(
        prompt_ids=torch.ones(4, 1, dtype=torch.long),
        prompt_mask=torch.ones(4, 1, dtype=torch.long),
        response_ids=resp,
        response_mask=mask,
        logp_mu=z,
        support=None,
        prompt_index=torch.tensor([i for i, _, _ in texts]),
    )
    assert p0.answer != p1.answer
    assert t.rollout_rewards([p0, p1], ro, tok).tolist() == [1.0, 0.0, 1.0, 0.0]


CHAT = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"  # noqa: E501


def test_prompts_go_into_the_tokenizers_chat_template_when_it_has_one(tmp_path):
    from harness.base.models import char_tokenizer

    path = str(write_jsonl(tmp_path / "d.jsonl", GSM[:4]))
    tok = char_tokenizer()
    raw = task("hf", path=path)
    raw.attach_tokenizer(tok)  # a base model's tokenizer: no template, raw text
    assert raw.sample(1, "train")[0].prompt.startswith("Q")
    tok.chat_template = CHAT
    chat, off = task("hf", path=path), task("hf", path=path, chat_template=False)
    chat.attach_tokenizer(tok)
    off.attach_tokenizer(tok)
    (p,), (q,) = chat.sample(1, "train"), off.sample(1, "train")
    assert p.prompt == f"<user>{q.prompt}<assistant>" and p.answer == q.answer
    assert chat.reward(p, "so 2,000") == chat.reward(q, "so 2,000")


# --- word_problems: generated GSM8K-layout problems for a real instruct model --------------------


def test_word_problems_are_deterministic_with_disjoint_splits():
    """Same (seed, split), same problems; the split is by the arithmetic (`info['expr']`), so no
    eval problem's numbers and operations occur in train, whatever the wording."""
    t = task("word_problems", steps=2, max_number=20)
    a, b = t.sample(50, "train", seed=3), t.sample(50, "train", seed=3)
    assert a == b and a != t.sample(50, "train", seed=4)
    train = {t.key(p) for s in range(4) for p in t.sample(500, "train", seed=s)}
    held = {t.key(p) for s in range(4) for p in t.sample(200, "eval", seed=s)}
    assert len(held) > 50 and not train & held


@pytest.mark.parametrize("kw", [{}, {"steps": 3, "max_number": 30}])
def test_word_problem_solutions_are_right_and_graded_by_math_verify(kw):
    """Each worked line 'x op y = z' is true and chains into the next; the last is the answer
    after '####'; the reference earns 1 and a wrong final number 0."""
    t = task("word_problems", **kw)
    for p in t.sample(40, "train", seed=0) + t.sample(10, "eval", seed=0):
        *lines, final = p.solution.split("\n")
        assert final == f"#### {p.answer}" and len(lines) == t.steps
        prev = None
        for line in lines:
            x, op, y, eq, z = line.split()
            assert eq == "=" and int(z) >= 1 and prev in (None, int(x))
            assert int(z) == (int(x) + int(y) if op == "+" else int(x) - int(y))
            assert f" {y} " in p.prompt  # each event's number is in the question
            prev = int(z)
        assert prev == int(p.answer)
        assert p.prompt == f"{p.info['question']} Answer with the number only."
        assert t.reward(p, p.solution) == 1.0
        assert t.reward(p, p.solution.replace(f"#### {p.answer}", f"#### {prev + 1}")) == 0.0
    assert t.reward(p, f"So the answer is {p.answer}.") == 1.0  # math-verify: any final form


def test_one_word_problem_by_hand():
    """A seeded draw, checked whole: its wording, worked line, answer and key agree."""
    import random

    from harness.tasks.word_problems import WORD_NAMES, WordProblemTask

    p = WordProblemTask(1, 10, 0.25, 48, "", True).draw(random.Random(0))
    name, _, n, item = p.prompt.rstrip("?").replace(".", "").split()[:4]
    assert name in WORD_NAMES and p.prompt.endswith(f"How many {item} does {name} have now?")
    (x, op, y, _, z), final = p.solution.split("\n")[0].split(), p.solution.split("\n")[1]
    assert x == n and p.info["expr"] == f"{x}{op}{y}" and final == f"#### {z}" == f"#### {p.answer}"
    verb = p.prompt.split(".")[1].split()[1]
    assert (op, verb) in {("+", "buys"), ("+", "finds"), ("-", "loses"), ("-", "sells")}


def test_word_problems_go_into_the_chat_template_when_the_tokenizer_has_one():
    from harness.base.models import char_tokenizer

    tok = char_tokenizer()
    raw = task("word_problems")
    raw.attach_tokenizer(tok)  # a base model's tokenizer: no template, raw text
    (r,) = raw.sample(1, "train")
    assert r.prompt == f"{r.info['question']} Answer with the number only."
    tok.chat_template = CHAT
    chat, off = task("word_problems"), task("word_problems", chat_template=False)
    chat.attach_tokenizer(tok)
    off.attach_tokenizer(tok)
    (p,), (q,) = chat.sample(1, "train"), off.sample(1, "train")
    assert p.prompt == f"<user>{r.prompt}<assistant>" and q == r and p.answer == r.answer
    assert chat.key(p) == raw.key(r)  # the split is the same: by the arithmetic, not the prompt
    # OPSD's teacher: the reference solution inside the user's turn, the template around it
    from harness.tasks import teacher_prompt

    assert teacher_prompt(p) == f"<user>Reference solution: {p.solution}\n{r.prompt}<assistant>"
    assert teacher_prompt(r) == f"Reference solution: {r.solution}\n{r.prompt}"  # no template


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"steps": 0}, r"task.steps=0; valid: an integer >= 1"),
        ({"max_number": 1}, r"task.max_number=1; valid"),
        ({"eval_frac": 0.0}, r"task.eval_frac=0.0; valid"),
    ],
)
def test_bad_word_problem_settings(kw, message):
    with pytest.raises(ValueError, match=message):
        task("word_problems", **kw)
