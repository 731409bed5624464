"""transformers' Llama decoding with its KV cache (``DynamicCache``, ``use_cache=True``) under
cgbackend.compile's default options: each decoder layer hands ``self.layer_idx`` to the cache
update, so Dynamo specialises every layer on it; regional compilation sees that in the first
layer's graph and compiles the stack with the model from the second call on (regional_modes.py)
instead of one shared function falling off Dynamo's recompile limit at the ninth layer. No layer runs uncompiled, nothing runs eagerly but warm-up, the logits are eager's,
and (on a GPU) a 16-layer decode step costs at most four 4-layer steps."""

from __future__ import annotations

import copy
import statistics

import pytest
import torch

import cgbackend

transformers = pytest.importorskip("transformers")


def _llama(layers: int, hidden: int, dtype: torch.dtype, device: str) -> tuple:
    config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=layers, vocab_size=128,
                                      max_position_embeddings=128)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype).eval(), config


def _decode(model, config, tokens: torch.Tensor, prompt: int, timer=None) -> list[torch.Tensor]:
    """The logits of a prompt, then of one token at a time (teacher-forced: ``tokens`` gives each
    step's input), through a DynamicCache; ``timer(step, fn)`` times each decode step."""
    with torch.no_grad():
        out = model(input_ids=tokens[:, :prompt], past_key_values=transformers.DynamicCache(config=config),
                    use_cache=True)
        logits = [out.logits[:, -1].float()]
        for step in range(prompt, tokens.shape[1]):
            def run(out=out, step=step):
                return model(input_ids=tokens[:, step:step + 1], past_key_values=out.past_key_values, use_cache=True)
            out = timer(step - prompt, run) if timer is not None else run()
            logits.append(out.logits[:, -1].float())
    return logits


def _check_counters(compiled, layers: int) -> None:
    st = cgbackend.stats(compiled)
    assert st["uncompiled_calls"] == 0, (st["uncompiled_by"], cgbackend.report(compiled).notes)
    assert set(st["eager_calls"]) <= {"warmup"}, st["eager_calls"]
    (stack,) = cgbackend.report(compiled).regional
    # The first layer's graph is specialised on self.self_attn.layer_idx, a value of its own for
    # every layer: the stack is compiled with the model from the second call on, and the other
    # layers ran as written at the first call instead of being compiled for one call each.
    assert [g["layers"] for g in stack["groups"]] == [[0]], stack["groups"]
    assert stack["with_model"] and f"{layers} values among its layers" in stack["why"], stack
    assert "self.self_attn.layer_idx" in stack["why"], stack


def test_nine_layer_llama_with_its_kv_cache_compiles_every_layer():
    layers, prompt = 9, 5
    model, config = _llama(layers, 32, torch.float64, "cpu")
    ref = copy.deepcopy(model)
    compiled = cgbackend.compile(model, simulate_graphs=True)
    tokens = torch.randint(0, config.vocab_size, (1, prompt + 1), generator=torch.Generator().manual_seed(1))
    mine, theirs = _decode(compiled, config, tokens, prompt), _decode(ref, config, tokens, prompt)
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    _check_counters(compiled, layers)


@pytest.mark.cuda
def test_sixteen_layer_llama_decode_step_costs_at_most_four_four_layer_steps():
    from cgbackend.bench.accuracy import rel_err
    prompt, steps, warm = 8, 16, 6
    medians = {}
    for layers in (4, 16):
        torch._dynamo.reset()
        model, config = _llama(layers, 256, torch.bfloat16, "cuda")
        ref64 = copy.deepcopy(model).double()
        eager = copy.deepcopy(model)
        compiled = cgbackend.compile(model)
        tokens = torch.randint(0, config.vocab_size, (1, prompt + steps), device="cuda",
                               generator=torch.Generator(device="cuda").manual_seed(1))
        times: list[float] = []

        def timer(step, fn):
            if step < warm:  # compiles, warm-up calls
                return fn()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
            return out

        mine = torch.stack(_decode(compiled, config, tokens, prompt, timer))
        base = torch.stack(_decode(eager, config, tokens, prompt))
        wide = torch.stack(_decode(ref64, config, tokens, prompt))
        assert rel_err(mine, wide) <= 2 * max(rel_err(base, wide), torch.finfo(torch.bfloat16).eps)
        st = cgbackend.stats(compiled)
        assert st["uncompiled_calls"] == 0 and set(st["eager_calls"]) <= {"warmup"}, st
        if layers >= 6:  # below regional_min_layers the model is one graph
            _check_counters(compiled, layers)
        medians[layers] = statistics.median(times)
    assert medians[16] <= 4 * medians[4], medians
