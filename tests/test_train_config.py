"""Run settings: presets kept unless a field is given, one source of truth, clear errors, resume checks."""

import pathlib
import runpy

import pytest

from r3jax.data import prompts, toy
from r3jax.train import config as run_config

REPO = pathlib.Path(__file__).resolve().parents[1]


def tiny():
    return runpy.run_path(str(REPO / "configs" / "tiny.py"))["get_config"]()


def test_the_algorithm_preset_holds_unless_a_field_is_given():
    c = tiny()
    c.algorithm = "grpo"
    rl = run_config.rl_config(c, valid_vocab=263)
    assert (rl.algorithm, rl.eps_high, rl.aggregation) == ("grpo", 0.2, "seq-mean-token-mean")
    c.rl.eps_high = 0.3
    c.rl.r3.replay = False
    rl = run_config.rl_config(c, valid_vocab=263)
    assert rl.eps_high == 0.3 and rl.r3.replay is False and rl.r3.replay_k == 2


def test_sampler_and_loss_settings_come_from_the_same_fields():
    c = tiny()
    c.temperature, c.max_new_tokens = 0.6, 12
    rl = run_config.rl_config(c, valid_vocab=263)
    assert (rl.temperature, rl.max_response_tokens, rl.valid_vocab) == (0.6, 12, 263)
    assert "temperature" not in c.rl and "max_response_tokens" not in c.rl and "valid_vocab" not in c.rl


def test_unknown_override_lists_close_names():
    with pytest.raises(run_config.ConfigError, match=r"'rl.r3.replya'; did you mean rl.r3.replay"):
        run_config.check_overrides(["--config.rl.r3.replya=False"], tiny())
    run_config.check_overrides(["--config.rl.r3.replay=False", "--workdir=x", "--config.steps", "3"], tiny())


def test_bad_values_name_their_field():
    c = tiny()
    c.samples_per_prompt = 0
    with pytest.raises(run_config.ConfigError, match="samples_per_prompt must be a positive integer"):
        run_config.check_values(c)
    c = tiny()
    c.rl.eps_low = 2.0
    with pytest.raises(run_config.ConfigError, match="eps_low"):
        run_config.rl_config(c, valid_vocab=263)
    for field, value, message in (("query_block", 0, "model.query_block must be a positive integer"),
                                  ("remat", "some", "model.remat must be one of")):
        c = tiny()
        c.model[field] = value
        with pytest.raises(run_config.ConfigError, match=message):
            run_config.check_values(c)


def test_shape_fields_are_reported_and_others_are_not():
    saved = tiny().to_dict()
    c = tiny()
    c.rl.learning_rate, c.steps = 5e-4, 100
    assert run_config.changed_shape_fields(saved, c) == []
    c.max_new_tokens, c.rl.r3.slots_wrong = 32, 3
    changed = run_config.changed_shape_fields(saved, c)
    assert changed == ["max_new_tokens (checkpoint: 16, now: 32)", "rl.r3.slots_wrong (checkpoint: None, now: 3)"]


def test_committed_toy_assets_are_what_the_builder_writes(tmp_path):
    toy.write_assets(tmp_path)
    committed = REPO / "configs" / "tiny"
    for path in sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file()):
        assert (committed / path).read_bytes() == (tmp_path / path).read_bytes(), path
    tokenizer = prompts.load_tokenizer(committed / "tokenizer")
    rendered = prompts.render(tokenizer, "What is 3 + 4?")
    assert rendered == "<｜begin▁of▁sentence｜><｜User｜>What is 3 + 4?<｜Assistant｜><think>\n"
    assert tokenizer.decode(prompts.encode(tokenizer, rendered)) == rendered
    assert len(tokenizer) == 263 and tokenizer.convert_tokens_to_ids("</think>") == 262


@pytest.mark.parametrize("name", ["r3", "grpo", "dapo"])
def test_the_paper_config_builds_each_algorithm(name):
    c = runpy.run_path(str(REPO / "configs" / "r1distill_1p5b.py"))["get_config"]()
    c.algorithm = name
    run_config.check_values(c)
    rl = run_config.rl_config(c, valid_vocab=151665)
    assert (rl.algorithm, rl.temperature, rl.max_response_tokens, rl.learning_rate) == (name, 0.6, 8192, 1e-6)
    groups = c.prompts_per_step + (rl.r3.max_reflection_prompts if rl.uses_reflection else 0)
    rows = groups * (c.samples_per_prompt + (rl.r3.replay_k if rl.uses_replay else 0))
    assert rows % rl.num_micro_batches == 0


@pytest.mark.parametrize("name, updates", [("r3", 85), ("grpo", 64), ("dapo", 64)])
def test_micro_batch_rows_keeps_the_rows_per_micro_batch_whatever_the_algorithm(name, updates):
    c = runpy.run_path(str(REPO / "configs" / "r1distill_1p5b.py"))["get_config"]()
    c.algorithm = name
    assert run_config.rl_config(c, valid_vocab=151665).num_micro_batches == updates  # 1360 or 1024 rows / 16


def test_micro_batches_that_do_not_split_the_loss_rows_are_refused_naming_the_field():
    c = tiny()  # (4 + 4 slots) x (4 + 2 replayed) = 48 loss rows
    c.micro_batch_rows = 10
    with pytest.raises(run_config.ConfigError, match="micro_batch_rows = 10 does not divide .* = 48 rows"):
        run_config.rl_config(c, valid_vocab=263)
    c.micro_batch_rows, c.rl.num_micro_batches = 0, 5
    with pytest.raises(run_config.ConfigError, match="rl.num_micro_batches = 5 does not divide"):
        run_config.rl_config(c, valid_vocab=263)
    c.micro_batch_rows = 12
    with pytest.raises(run_config.ConfigError, match="both set"):
        run_config.rl_config(c, valid_vocab=263)
