"""The layouts of `models.packing` by hand (prompt sharing, blocks packed several to a row, single
sequences told apart by their positions), and their forwards equal each row run alone in float64
(hidden states and parameter gradients), for both attention implementations that take 4D masks."""

from __future__ import annotations

import pytest
import torch

from ppo_trainer.models.packing import Layout, pack_rows, states_before_response_tokens

SHARED = Layout(share_prompts=True)
LAYOUTS = {"shared": SHARED, "shared-packed": Layout(share_prompts=True, pack=True), "by-positions": Layout(pack=True)}


def padded_rows(rows: list[tuple[list[int], list[int]]]):
    """input_ids, attention_mask, position_ids [B, P+T], response_mask [B, T] of (prompt, response) rows."""
    P, T = max(len(p) for p, _ in rows), max(len(r) for _, r in rows)
    ids = torch.zeros(len(rows), P + T, dtype=torch.long)
    attn = torch.zeros(len(rows), P + T, dtype=torch.long)
    for i, (p, r) in enumerate(rows):
        ids[i, P - len(p) : P + len(r)] = torch.tensor(p + r)
        attn[i, P - len(p) : P + len(r)] = 1
    return ids, attn, (attn.cumsum(1) - 1).clamp(min=0), attn[:, P:].clone()


def test_two_samples_of_one_prompt_pack_into_one_row_that_hides_them_from_each_other():
    rows = [([5, 6], [7, 8]), ([5, 6], [9]), ([4, 5, 6], [3, 3])]  # rows 0, 1 share the prompt [5, 6]
    packed = pack_rows(*padded_rows(rows), SHARED)
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9], [4, 5, 6, 3, 3]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 2], [0, 1, 2, 3, 4]]
    allowed = packed.attention_mask[0, 0].int().tolist()
    assert allowed == [[1, 0, 0, 0, 0],
                       [1, 1, 0, 0, 0],
                       [1, 1, 1, 0, 0],   # sample 0 sees the prompt and itself
                       [1, 1, 1, 1, 0],
                       [1, 1, 0, 0, 1]]   # sample 1 sees the prompt, never sample 0
    assert packed.attention_mask[1, 0].int().tolist() == torch.ones(5, 5).tril().int().tolist()
    # the state before each response token: rows 0 and 1 both predict their first token from column 1
    assert packed.predicting_rows.tolist() == [0, 0, 0, 1, 1]
    assert packed.predicting_cols.tolist() == [1, 2, 1, 2, 3]


def test_padding_queries_attend_themselves_so_no_softmax_row_is_empty():
    rows = [([5, 6], [7, 8, 9]), ([4], [3])]  # packed widths 5 and 2
    packed = pack_rows(*padded_rows(rows), SHARED)
    assert packed.input_ids.shape == (2, 5)
    assert torch.all(packed.attention_mask.any(dim=-1))
    assert not packed.attention_mask[1, 0, :2, 2:].any()  # padding is never a key of a real token


def test_blocks_of_different_prompts_share_a_row_and_never_see_each_other():
    rows = [([5, 6], [7, 8, 9]), ([5, 6], [9]), ([4], [3]), ([2], [1, 1])]  # blocks of 6, 2 and 3 tokens
    packed = pack_rows(*padded_rows(rows), LAYOUTS["shared-packed"])
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 9], [2, 1, 1, 4, 3, 0]]  # longest first: 6 | 3 + 2
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 2], [0, 1, 2, 0, 1, 0]]
    block = torch.ones(3, 3).tril()
    expected = torch.block_diag(block, block[:2, :2], torch.ones(1, 1)).int().tolist()  # padding sees itself
    assert packed.attention_mask[1, 0].int().tolist() == expected
    # row 2's token 3 is predicted from its prompt [4] at column 3; row 3's from [2] at column 0
    assert packed.predicting_rows.tolist() == [0, 0, 0, 0, 1, 1, 1]
    assert packed.predicting_cols.tolist() == [1, 2, 3, 1, 3, 0, 1]


def test_single_sequences_pack_with_restarting_positions_and_no_mask():
    rows = [([5, 6], [7, 8, 9]), ([5, 6], [9]), ([4], [3])]  # sequences of 5, 3 and 2 tokens
    packed = pack_rows(*padded_rows(rows), LAYOUTS["by-positions"])
    assert packed.attention_mask is None
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 6, 9, 4, 3]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 1]]
    assert packed.predicting_cols.tolist() == [1, 2, 3, 1, 3]


@pytest.fixture(scope="module")
def float64_decoder(tiny_model_dir):
    from transformers import AutoModel

    return AutoModel.from_pretrained(tiny_model_dir, dtype=torch.float64)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_packed_states_and_gradients_equal_each_row_run_alone_in_float64(float64_decoder, implementation, layout):
    """The reference runs every row by itself, unpadded: the states before its response tokens
    and the gradient of the same weighted sum, over all rows."""
    float64_decoder.config._attn_implementation = implementation
    gen = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, 90, (n,), generator=gen).tolist()

    prompts = [tokens(4), tokens(2), tokens(5)]  # 3 prompts: 3, 2 and 1 samples, uneven responses
    rows = [(prompts[0], tokens(3)), (prompts[0], tokens(6)), (prompts[0], tokens(1)),
            (prompts[1], tokens(2)), (prompts[1], tokens(5)), (prompts[2], tokens(4))]
    inputs = padded_rows(rows)
    assert pack_rows(*inputs, LAYOUTS[layout]).input_ids.numel() < inputs[0].numel()  # it does pack
    weights = torch.randn(sum(len(r) for _, r in rows), float64_decoder.config.hidden_size, generator=gen,
                          dtype=torch.float64)

    def grads() -> dict[str, torch.Tensor]:
        out = {n: p.grad.clone() for n, p in float64_decoder.named_parameters()}
        float64_decoder.zero_grad(set_to_none=True)
        return out

    packed = states_before_response_tokens(float64_decoder, *inputs, LAYOUTS[layout])
    (packed * weights).sum().backward()
    packed_grads = grads()
    alone = []
    for prompt, response in rows:
        hidden = float64_decoder(input_ids=torch.tensor([prompt + response])).last_hidden_state[0]
        alone.append(hidden[len(prompt) - 1 : -1])
    alone = torch.cat(alone)
    (alone * weights).sum().backward()
    # transformers' Llama takes RMSNorm statistics, rotary tables and eager's softmax in float32 whatever
    # the model's dtype: the two orders of summation differ by float32 rounding of the largest terms
    torch.testing.assert_close(packed, alone, atol=1e-6 * float(alone.detach().abs().max()), rtol=0)
    for name, grad in grads().items():
        torch.testing.assert_close(packed_grads[name], grad, atol=1e-6 * float(grad.abs().max()), rtol=0,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_rows_with_distinct_prompts_take_the_plain_path_with_the_packed_paths_results(tiny_model_dir, implementation,
                                                                                    monkeypatch):
    """sampler.n=1: no prompt repeats, so nothing is packed (no dense 4D mask: fused kernels stay on);
    the states equal each row run alone. In float32, the trainer's dtype: transformers' eager
    attention masks left padding with -inf in float64, and a padding row's NaN reaches the others."""
    from transformers import AutoModel

    import ppo_trainer.models.packing as packing

    decoder = AutoModel.from_pretrained(tiny_model_dir, dtype=torch.float32)
    decoder.config._attn_implementation = implementation
    gen = torch.Generator().manual_seed(1)
    rows = [(torch.randint(3, 90, (p,), generator=gen).tolist(), torch.randint(3, 90, (r,), generator=gen).tolist())
            for p, r in ((4, 3), (2, 5), (5, 1))]
    inputs = padded_rows(rows)
    packed = []
    real_pack = packing.pack_rows
    monkeypatch.setattr(packing, "pack_rows", lambda *a: packed.append(1) or real_pack(*a))
    with torch.no_grad():
        plain = states_before_response_tokens(decoder, *inputs, SHARED)
        assert packed == [], "distinct prompts are not packed"
        states_before_response_tokens(decoder, *padded_rows([rows[0], rows[0]]), SHARED)  # a repeated prompt still packs
        assert packed == [1]
        alone = torch.cat([decoder(input_ids=torch.tensor([p + r])).last_hidden_state[0][len(p) - 1 : -1]
                           for p, r in rows])
    # float32 summation orders differ by a few ulps of the largest terms
    torch.testing.assert_close(plain, alone, atol=1e-5 * float(alone.abs().max()), rtol=0)
