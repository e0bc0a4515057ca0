"""The jitted sampler: HF-exact greedy decoding, exact log-probs/entropies, stops, truncation, sharding."""

import re

import jax
import numpy as np
import pytest
from sampler_cases import VOCAB, prompts, ragged_run, sampler_checkpoint

from r3jax import model as rm
from r3jax.model import attention, sharding
from r3jax.sampling import generate, sampler, slots


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return sampler_checkpoint(tmp_path_factory)


def first_end(row, eos):
    hits = np.flatnonzero(row == eos)
    return hits[0] + 1 if hits.size else None


def test_greedy_equals_transformers_token_for_token(checkpoint):
    import torch

    _, hf, model = checkpoint
    tokens, mask = prompts()
    free = generate(model, tokens, mask, jax.random.key(0), max_new_tokens=12, temperature=0.0)
    eos = int(np.asarray(free.tokens)[0, 4])  # a token greedy really produces, so stopping is exercised
    ours = generate(model, tokens, mask, jax.random.key(0), max_new_tokens=12, temperature=0.0, eos_ids=(eos,),
                    pad_id=0)
    with torch.no_grad():
        ref = hf.generate(torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(np.int64)), do_sample=False,
                          max_new_tokens=12, eos_token_id=eos, pad_token_id=0).numpy()[:, 6:]
    ref = np.pad(ref, ((0, 0), (0, 12 - ref.shape[1])))
    ours_tokens = np.asarray(ours.tokens)
    np.testing.assert_array_equal(ours_tokens, ref)
    free_tokens = np.asarray(free.tokens)
    for row in range(3):
        assert int(ours.lengths[row]) == (first_end(free_tokens[row], eos) or 12)
    assert int(ours.lengths[0]) <= 5


def teacher_forced_logits(model, tokens, mask, rollout, g=1):
    prompt = np.repeat(tokens, g, axis=0)
    prompt_mask = np.repeat(mask, g, axis=0)
    full = np.concatenate([prompt, np.asarray(rollout.tokens)], 1)
    full_mask = np.concatenate([prompt_mask, np.asarray(rollout.mask)], 1)
    logits = np.asarray(model(full, attention_mask=full_mask), np.float64)
    return logits[:, prompt.shape[1] - 1:-1]  # the prediction of each response token


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_and_entropies_match_a_teacher_forced_forward(checkpoint, temperature):
    _, _, model = checkpoint
    tokens, mask = prompts()
    out = generate(model, tokens, mask, jax.random.key(3), max_new_tokens=10, temperature=temperature,
                   top_k=20, top_p=0.9, num_samples=2)
    logits = teacher_forced_logits(model, tokens, mask, out, g=2) / temperature
    logp_all = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    sampled = np.asarray(out.tokens)
    ref_logp = np.take_along_axis(logp_all, sampled[..., None], -1)[..., 0]
    ref_ent = -(np.exp(logp_all) * logp_all).sum(-1)
    m = np.asarray(out.mask)
    np.testing.assert_allclose(np.asarray(out.logprobs)[m], ref_logp[m], atol=1e-4)
    np.testing.assert_allclose(np.asarray(out.entropies)[m], ref_ent[m], atol=1e-4)
    assert not np.asarray(out.logprobs)[~m].any() and not np.asarray(out.entropies)[~m].any()


def test_end_tokens_stop_rows_and_mask_what_follows(checkpoint):
    _, _, model = checkpoint
    tokens, mask = prompts()
    key = jax.random.key(11)
    free = np.asarray(generate(model, tokens, mask, key, max_new_tokens=16, num_samples=2).tokens)
    eos_a, eos_b = int(free[0, 3]), int(free[3, 7])
    out = generate(model, tokens, mask, key, max_new_tokens=16, num_samples=2, eos_ids=(eos_a, eos_b), pad_id=0)
    got = np.asarray(out.tokens)
    for row in range(free.shape[0]):
        ends = [e for e in (first_end(free[row], eos_a), first_end(free[row], eos_b)) if e]
        length = min(ends) if ends else 16
        assert int(out.lengths[row]) == length
        assert bool(out.truncated[row]) == (not ends)
        np.testing.assert_array_equal(got[row, :length], free[row, :length])  # same draws until the end
        assert not got[row, length:].any()
        np.testing.assert_array_equal(np.asarray(out.mask[row]), np.arange(16) < length)


def test_truncated_means_no_end_token_within_budget(checkpoint):
    _, _, model = checkpoint
    tokens, mask = prompts()
    out = generate(model, tokens, mask, jax.random.key(5), max_new_tokens=4, eos_ids=(VOCAB + 5,))
    assert np.asarray(out.truncated).all() and (np.asarray(out.lengths) == 4).all()


def test_top_k_1_equals_greedy(checkpoint):
    _, _, model = checkpoint
    tokens, mask = prompts()
    greedy = generate(model, tokens, mask, jax.random.key(0), max_new_tokens=8, temperature=0.0)
    top1 = generate(model, tokens, mask, jax.random.key(9), max_new_tokens=8, temperature=1.3, top_k=1)
    np.testing.assert_array_equal(np.asarray(top1.tokens), np.asarray(greedy.tokens))


def test_vanishing_temperature_approaches_greedy(checkpoint):
    _, _, model = checkpoint
    tokens, mask = prompts()
    greedy = generate(model, tokens, mask, jax.random.key(0), max_new_tokens=8, temperature=0.0)
    cold = generate(model, tokens, mask, jax.random.key(4), max_new_tokens=8, temperature=1e-4)
    np.testing.assert_array_equal(np.asarray(cold.tokens), np.asarray(greedy.tokens))
    assert np.isfinite(np.asarray(cold.logprobs)).all() and np.isfinite(np.asarray(cold.entropies)).all()
    assert np.abs(np.asarray(cold.logprobs)).max() < 1e-3 and np.asarray(cold.entropies).max() < 1e-2


def test_samples_of_a_prompt_share_its_prefill(checkpoint):
    _, _, model = checkpoint
    tokens, mask = prompts()
    one = generate(model, tokens, mask, jax.random.key(0), max_new_tokens=6, temperature=0.0)
    four = generate(model, tokens, mask, jax.random.key(0), max_new_tokens=6, temperature=0.0, num_samples=4)
    np.testing.assert_array_equal(np.asarray(four.tokens), np.repeat(np.asarray(one.tokens), 4, axis=0))
    sampled = np.asarray(generate(model, tokens, mask, jax.random.key(1), max_new_tokens=6, num_samples=4).tokens)
    assert len({tuple(r) for r in sampled[:4]}) > 1  # G samples of one prompt differ


def test_right_padded_prompts_give_the_same_responses(checkpoint):
    _, _, model = checkpoint
    tokens, mask = prompts()
    right_tokens = np.zeros_like(tokens)
    right_mask = np.zeros_like(mask)
    for i in range(3):
        n = mask[i].sum()
        right_tokens[i, :n], right_mask[i, :n] = tokens[i, mask[i]], True
    a = generate(model, tokens, mask, jax.random.key(2), max_new_tokens=6)
    b = generate(model, right_tokens, right_mask, jax.random.key(2), max_new_tokens=6)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    np.testing.assert_allclose(np.asarray(a.logprobs), np.asarray(b.logprobs), atol=1e-5)


def test_same_key_same_samples_other_key_other_samples(checkpoint):
    _, _, model = checkpoint
    tokens, mask = prompts()
    run = lambda k: np.asarray(generate(model, tokens, mask, jax.random.key(k), max_new_tokens=8).tokens)  # noqa: E731
    np.testing.assert_array_equal(run(21), run(21))
    assert (run(21) != run(22)).any()


def test_ids_beyond_the_tokenizer_are_never_sampled(checkpoint):
    _, _, model = checkpoint
    tokens, mask = prompts()
    out = generate(model, tokens, mask, jax.random.key(8), max_new_tokens=16, num_samples=8, temperature=2.0,
                   valid_vocab=40)
    assert np.asarray(out.tokens)[np.asarray(out.mask)].max() < 40


def test_no_recompilation_for_same_shapes(checkpoint):
    _, _, model = checkpoint
    compiles = []

    def on_event(event, *args, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(on_event)
    tokens, mask = prompts()
    kw = dict(max_new_tokens=5, top_p=0.8, eos_ids=(3,), num_samples=2)
    generate(model, tokens, mask, jax.random.key(0), **kw)
    before = len(compiles)
    assert before > 0  # the listener sees compilations (this config is new to the process)
    other = np.random.RandomState(1).randint(3, VOCAB, tokens.shape)
    generate(model, other, mask, jax.random.key(1), **kw)
    generate(model, tokens, np.ones_like(mask), jax.random.key(2), **kw)
    assert len(compiles) == before


@pytest.mark.parametrize("unroll", [True, False], ids=["per_layer_cache", "stacked_cache"])
@pytest.mark.parametrize("count, shared", [(4, True), (6, False)], ids=["prompts_shared", "prompts_copied"])
def test_sharded_run_equals_single_device(checkpoint, unroll, count, shared):
    """A static batch of 2 samples on a mesh that splits rows over 4 devices: 4 prompts, whose rows read them
    from one shared copy on their own device (`slots.shares_prompts`), or 6, which 4 devices do not split,
    each row's cache a copy of its prompt's; in the per-layer cache and in the stacked one (TPU's)."""
    folder, _, model = checkpoint
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    sharded, _ = rm.load_pretrained(folder, mesh=mesh, sharding_mode="sample")
    tokens, mask = prompts()
    tokens, mask = np.tile(tokens, (2, 1))[:count], np.tile(mask, (2, 1))[:count]
    assert slots.shares_prompts(count, 2, (2 * count,), mesh) == shared
    kw = dict(max_new_tokens=8, num_samples=2, eos_ids=(5,), unroll_layers=unroll, share_prompts=True)
    a = generate(model, tokens, mask, jax.random.key(6), **kw)
    b = generate(sharded, tokens, mask, jax.random.key(6), **kw)
    for x in jax.tree.leaves(b):  # every output split by row, as the prompts are
        assert x.sharding.spec[0] == ("data", "fsdp")
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    np.testing.assert_allclose(np.asarray(a.entropies), np.asarray(b.entropies), atol=1e-5)


@pytest.mark.parametrize("unroll", [True, False], ids=["per_layer_cache", "stacked_cache"])
def test_sharing_prompts_changes_no_rollout(checkpoint, unroll):
    """Six ragged, left-padded prompts x 3 samples with end tokens: read from one shared copy per prompt, or each
    row from its own, the rollout is the same (tokens and lengths exactly, log-probs and entropies to 1e-6)."""
    _, _, model = checkpoint
    tokens, mask = prompts()
    tokens, mask = np.concatenate([tokens, tokens[::-1]]), np.concatenate([mask, mask[::-1]])
    kw = dict(max_new_tokens=10, num_samples=3, eos_ids=tuple(range(3, 128, 9)), unroll_layers=unroll)
    shared, copied = (generate(model, tokens, mask, jax.random.key(5), share_prompts=share, **kw)
                      for share in (True, False))
    assert 1 < len(set(np.asarray(shared.lengths).tolist()))  # rows end at different steps
    np.testing.assert_array_equal(np.asarray(shared.tokens), np.asarray(copied.tokens))
    np.testing.assert_array_equal(np.asarray(shared.lengths), np.asarray(copied.lengths))
    np.testing.assert_allclose(np.asarray(shared.logprobs), np.asarray(copied.logprobs), atol=1e-6)
    np.testing.assert_allclose(np.asarray(shared.entropies), np.asarray(copied.entropies), atol=1e-6)


def test_only_a_static_batch_of_samples_shares_its_prompts():
    """A shared prompt needs each prompt's G rows side by side in their slots (a static batch), G > 1, and on a
    mesh the prompts split over the devices as the rows are."""
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)  # rows split over 4 devices
    assert slots.shares_prompts(3, 2, (6,), None)
    assert not slots.shares_prompts(3, 1, (3,), None)      # one sample: nothing to share
    assert not slots.shares_prompts(3, 2, (4, 1), None)    # refilled slots: any row in any slot
    assert slots.shares_prompts(8, 2, (16,), mesh)
    assert not slots.shares_prompts(6, 2, (12,), mesh)     # 4 devices do not split 6 prompts


def test_a_static_batch_holds_each_prompt_once(checkpoint):
    """The compiled static program (stacked cache, as on TPU) keeps the prompts' keys and values [L, P, K, Tp,
    H] once, and each row's own cache only its response: no [L, P·G, K, Tp + T, H] buffer of prompt copies."""
    _, _, model = checkpoint
    tokens, mask = prompts()  # 3 prompts of 6 slots
    c = model.config
    cfg = sampler.SamplingConfig(max_new_tokens=9, num_samples=4, unroll_layers=False, share_prompts=True)
    widths, groups = sampler.schedule(3, 4, None)
    hlo = sampler._generate.lower(*rm.split_params(model)[:1], cfg, widths, groups, rm.split_params(model)[1],
                                  tokens, mask, jax.random.key(0)).compile().as_text()
    layers, kv, h = c.num_hidden_layers, c.num_key_value_heads, c.head_dim
    assert f"f32[{layers},3,{kv},6,{h}]" in hlo
    assert f"f32[{layers},12,{kv},9,{h}]" in hlo
    assert f"f32[{layers},12,{kv},15,{h}]" not in hlo


@pytest.mark.parametrize("unroll", [True, False], ids=["per_layer_cache", "stacked_cache"])
@pytest.mark.parametrize("copies, groups", [(4, 4), (2, 4), (1, 1)],
                         ids=["prompts_split_by_device", "rows_split_prompts_whole", "rows_not_split_evenly"])
def test_refilled_slots_on_a_mesh_give_the_single_device_rollout(checkpoint, copies, groups, unroll):
    """Rows refilled into 4 slots on a mesh that splits rows over 4 devices (`sampler.schedule`): 12 prompts
    (4 groups, each taking its prompts from its own device's block), 6 prompts of 2 samples (12 rows: 4
    groups, the prompts, which 4 does not divide, whole on every device), 3 prompts (6 rows: one group). The
    rollout is the single-device one in each case."""
    folder, _, model = checkpoint
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    sharded, _ = rm.load_pretrained(folder, mesh=mesh, sharding_mode="sample")
    tokens, mask = prompts()
    tokens, mask = np.tile(tokens, (copies, 1)), np.tile(mask, (copies, 1))
    assert sampler.schedule(tokens.shape[0], 2, 4, mesh)[1] == groups
    kw = dict(max_new_tokens=9, num_samples=2, eos_ids=tuple(range(3, 128, 9)), unroll_layers=unroll)
    (a, _), (b, cost) = (sampler.decode(m, tokens, mask, jax.random.key(8), slots=s, **kw)
                         for m, s in ((model, None), (sharded, 4)))
    lengths = np.asarray(a.lengths)
    assert 1 < len(set(lengths.tolist()))  # rows end at different steps, so slots are refilled
    assert int(cost["slot_steps"]) < lengths.size * 9
    np.testing.assert_array_equal(np.asarray(b.tokens), np.asarray(a.tokens))
    np.testing.assert_array_equal(np.asarray(b.lengths), lengths)
    np.testing.assert_allclose(np.asarray(b.logprobs), np.asarray(a.logprobs), atol=1e-5)


@pytest.mark.parametrize("slot_count, widths", [(8, (8, 4)), (None, (24,))], ids=["refilled", "static_shared"])
def test_sampling_moves_no_cache_across_devices(checkpoint, slot_count, widths):
    """With the rows in per-device groups, seating rows and narrowing the slots gather and scatter within each
    device's block, and a static batch's rows read their shared prompts on their own device: no collective of
    the compiled program (the stacked cache, as on TPU) moves keys, values or cache masks between devices.
    (Before the groups, seating all-gathered the prompts' keys [L, B, K, 6, 16] and the mask [B, 67]; on the
    1.5B v5e:4x8 plan with 256 slots, 12.5 GiB a chip against 4.8 now.)"""
    folder, _, _ = checkpoint
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    sharded, _ = rm.load_pretrained(folder, mesh=mesh, sharding_mode="sample")
    tokens, mask = prompts()  # 6 prompt slots
    tokens, mask = np.tile(tokens, (4, 1)), np.tile(mask, (4, 1))
    widths_, groups = sampler.schedule(12, 2, slot_count, mesh)
    assert (widths_, groups) == (widths, 4)
    assert slots.shares_prompts(12, 2, widths, mesh) == (slot_count is None)
    cfg = sampler.SamplingConfig(max_new_tokens=61, num_samples=2, eos_ids=(3,), unroll_layers=False,
                                 share_prompts=True)  # 67 slots (61 with the prompts shared)
    graphdef, params = rm.split_params(sharded)
    batch = sharding.named(mesh, "act_bt", tokens.shape)
    hlo = sampler._generate.lower(graphdef, cfg, widths, groups, params, jax.device_put(tokens, batch),
                                  jax.device_put(mask, batch), jax.random.key(0)).compile().as_text()
    moved = re.findall(r"= (\w+\[[\d,]*\])[^=\n]*? (?:all-gather|all-to-all|collective-permute|all-reduce)\(", hlo)
    assert moved  # the step's own collectives (logits over `tensor`, counts) are there and seen
    cache_like = re.compile(r"f32\[[\d,]*,(6|61|67),16\]|f32\[[\d,]*,16,(6|61|67)\]|pred\[\d+,(6|61|67)\]")
    assert not [shape for shape in moved if cache_like.fullmatch(shape)]


@pytest.mark.parametrize("head_slots, budget, slots", [(128, 11, 3), (2, 12, 3), (2, 13, None)],
                         ids=["head_holds_all", "tail_after_2", "static_batch"])
def test_scanned_and_unrolled_decoding_agree(checkpoint, monkeypatch, head_slots, budget, slots):
    """The unrolled loop's per-layer cache (a head of the prompt + `HEAD_RESPONSE_SLOTS`, then a tail read
    in blocks of 4 here) against the scanned loop's stacked cache, with rows refilled into 3 slots, and as one
    static batch (the stacked cache then built from the prompts' before the loop: `slots.seat_all`). (Each case its
    own budget: a new shape, so a new trace that reads the patched constants.)"""
    monkeypatch.setattr(sampler, "HEAD_RESPONSE_SLOTS", head_slots)
    monkeypatch.setattr(attention, "CACHE_BLOCK", 4)
    _, _, model = checkpoint
    tokens, mask = prompts()
    kw = dict(max_new_tokens=budget, num_samples=2, eos_ids=(3,), slots=slots)
    a = generate(model, tokens, mask, jax.random.key(12), **kw)
    b = generate(rm.split_params(model), tokens, mask, jax.random.key(12), unroll_layers=False, **kw)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    np.testing.assert_allclose(np.asarray(a.logprobs), np.asarray(b.logprobs), atol=1e-5)


@pytest.mark.parametrize("slots", [7, 1])
def test_the_slot_count_never_changes_the_rollout(checkpoint, slots):
    _, _, model = checkpoint
    (every, _), (few, _) = ragged_run(model, None), ragged_run(model, slots)
    lengths = np.asarray(every.lengths)
    assert 1 < len(set(lengths.tolist())) and lengths.min() < 14 // 2  # rows really end at different steps
    np.testing.assert_array_equal(np.asarray(few.tokens), np.asarray(every.tokens))
    np.testing.assert_array_equal(np.asarray(few.lengths), lengths)
    np.testing.assert_array_equal(np.asarray(few.truncated), np.asarray(every.truncated))
    np.testing.assert_allclose(np.asarray(few.logprobs), np.asarray(every.logprobs), atol=1e-6)
    np.testing.assert_allclose(np.asarray(few.entropies), np.asarray(every.entropies), atol=1e-6)


def test_a_finished_row_hands_its_slot_to_the_next_waiting_row(checkpoint):
    _, _, model = checkpoint
    one, cost = ragged_run(model, 1)
    assert int(cost["slot_steps"]) == int(cost["steps"]) == int(np.asarray(one.lengths).sum())  # never idle
    four, cost = ragged_run(model, 4)
    lengths = np.asarray(four.lengths)
    # Four slots stay busy while rows wait; the last rows' tail runs on one slot (4 -> 1): idle slot-steps
    # come only from the steps when 4 slots held 2 to 4 rows.
    assert sampler.slot_widths(4) == (4, 1)
    assert int(cost["slot_steps"]) - lengths.sum() <= 3 * lengths.max()
    assert int(cost["steps"]) < lengths.size * lengths.max() // 4


def test_the_slots_narrow_by_quarters_in_multiples_of_the_row_shards():
    assert sampler.slot_widths(64) == (64, 16, 4, 1)
    assert sampler.slot_widths(64, 8) == (64, 16, 8)
    assert sampler.slot_widths(7) == (7, 1)
    assert sampler.slot_widths(1) == (1,)


def test_a_larger_budget_changes_nothing_already_generated(checkpoint):
    _, _, model = checkpoint
    tokens, mask = prompts()
    short = generate(model, tokens, mask, jax.random.key(0), max_new_tokens=6, temperature=0.0)
    long = generate(model, tokens, mask, jax.random.key(0), max_new_tokens=600, temperature=0.0, eos_ids=(VOCAB,))
    np.testing.assert_array_equal(np.asarray(long.tokens)[:, :6], np.asarray(short.tokens))
    np.testing.assert_allclose(np.asarray(long.logprobs)[:, :6], np.asarray(short.logprobs), atol=1e-5)


def test_bad_inputs_are_named(checkpoint):
    _, _, model = checkpoint
    tokens, mask = prompts()
    with pytest.raises(TypeError, match="Qwen2 model or its"):
        generate({"not": "a model"}, tokens, mask, jax.random.key(0), max_new_tokens=2)
    empty = mask.copy()
    empty[1] = False
    with pytest.raises(ValueError, match=r"prompt rows \[1\] have no real token"):
        generate(model, tokens, empty, jax.random.key(0), max_new_tokens=2)
    with pytest.raises(ValueError, match="top_p must be in"):
        generate(model, tokens, mask, jax.random.key(0), max_new_tokens=2, top_p=0.0)
    with pytest.raises(ValueError, match="slots must be >= 1, got 0"):
        generate(model, tokens, mask, jax.random.key(0), max_new_tokens=2, slots=0)


def test_the_loop_narrows_only_when_slots_are_given():
    """`loop_widths` (what `generate` runs and `memory_plan` compiles): without slots every row decodes at once
    to the end; with them, the slots narrow by quarters (`slot_widths`)."""
    assert sampler.loop_widths(64, None) == (64,)
    assert sampler.loop_widths(64, 32) == sampler.slot_widths(32) == (32, 8, 2, 1)
    assert sampler.loop_widths(8, 32) == (8, 2, 1)
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)  # rows split over 4 devices
    assert sampler.loop_widths(64, 30, mesh) == (32, 8, 4)  # slots rounded up to a multiple of 4
