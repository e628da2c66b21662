"""Generation engine: cached greedy decoding equals full-forward greedy decoding (transformers oracle
and our own no-cache path), chunked prefill, static decode shapes, sampling, CLI contract."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

import m3jax
from m3jax import aot, generate
from m3jax import engine as eng
from m3jax.engine import Engine, SamplingParams, sample
from tests.conftest import rel_l2, tiny_config

GREEDY = SamplingParams(temperature=0.0)


@pytest.mark.oracle
@pytest.mark.parametrize("name,chunk,steps_per_call", [("text_mixed", 16, 1), ("text_wide_block", 48, 3),
                                                       ("text_wide_block", 512, eng.DECODE_STEPS_PER_CALL)])
def test_cached_greedy_equals_oracle_full_forward(oracle_dir, name, chunk, steps_per_call):
    """Greedy fp32 through the decode loop equals transformers, at two prefill chunk sizes, one
    decode step per call and several (3 does not divide the 31 decode steps: the last call's extra
    steps are discarded)."""
    fx = np.load(oracle_dir / name / "fixture.npz")
    model = m3jax.load_pretrained(oracle_dir / name, dtype="float32", progress=False)
    ids, ref_ids = fx["input_ids"], fx["greedy_ids"]
    n = ref_ids.shape[1]
    assert n >= 32 and ids.shape[1] > model.config.text.index_topk_blocks * model.config.text.index_block_size
    e = Engine(model.params, model.config, batch=ids.shape[0], capacity=ids.shape[1] + n, prefill_chunk=chunk,
               decode_steps_per_call=steps_per_call)
    res = e.generate([list(r) for r in ids], max_new_tokens=n, sampling=GREEDY, keep_logits=True)
    np.testing.assert_array_equal(np.array(res.generated), ref_ids)
    steps = np.stack(res.step_logits, axis=1)
    assert rel_l2(steps, fx["greedy_logits"]) <= 1e-5
    # Our own no-cache path: one causal forward over prompt + generated gives every step's logits.
    full = m3jax.forward(model, np.concatenate([ids, ref_ids], axis=1)).logits
    own = np.asarray(full)[:, ids.shape[1] - 1 : ids.shape[1] - 1 + n]
    assert rel_l2(steps, own) <= 1e-5


def test_batch_of_different_lengths_and_static_decode():
    """Prompts of different lengths in one batch; decode compiled once, reused for every token."""
    cfg = tiny_config(index_block_size=4, index_topk_blocks=2)
    model = m3jax.init_random(cfg, seed=1)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 80, n).tolist() for n in (23, 9, 17)]
    e = Engine(model.params, cfg, batch=3, capacity=64, prefill_chunk=8, decode_steps_per_call=4)
    res = e.generate(prompts, max_new_tokens=12, sampling=GREEDY, keep_logits=True)
    compiled = len(aot._memo)
    # One causal forward over the three rows, padded at the end (one compile, not one per length):
    # a row's logits up to its last token see nothing of the padding after it.
    rows = [p + g for p, g in zip(prompts, res.generated)]
    width = max(map(len, rows))
    full = np.asarray(m3jax.forward(model, np.array([r + [0] * (width - len(r)) for r in rows])).logits)
    for b, p in enumerate(prompts):
        steps = np.stack([s[b] for s in res.step_logits])
        assert rel_l2(steps, full[b, len(p) - 1 : len(p) - 1 + 12]) <= 1e-5, f"sequence {b}"
    e2 = Engine(model.params, cfg, batch=3, capacity=64, prefill_chunk=8, decode_steps_per_call=4)
    e2.generate(prompts, max_new_tokens=20, sampling=GREEDY, seed=3, keep_logits=True)
    assert len(aot._memo) == compiled, "a program recompiled for a new token or engine"
    # Sampling runs inside the programs: per sampling mode one more decode program and one more
    # first-token program, none per token.
    e2.generate(prompts, max_new_tokens=20, sampling=SamplingParams(0.8, 0.9, 5), seed=3, keep_logits=True)
    assert len(aot._memo) == compiled + 2


def test_sampling_rules():
    logits = jax.random.normal(jax.random.key(0), (4, 50)) * 3
    key = jax.random.key(1)
    np.testing.assert_array_equal(sample(logits, key, SamplingParams(1.0, 1.0, 1)), np.argmax(logits, -1))
    a = sample(logits, key, SamplingParams(1.0, 0.95, 40))
    np.testing.assert_array_equal(a, sample(logits, key, SamplingParams(1.0, 0.95, 40)))
    top5 = np.argsort(-np.asarray(logits), -1)[:, :5]
    for s in range(20):
        t = np.asarray(sample(logits, jax.random.key(s), SamplingParams(1.0, 1.0, 5)))
        assert all(t[i] in top5[i] for i in range(4))
    # top-p so small that only the argmax survives (top-k = the whole vocabulary of 50)
    t = sample(logits, key, SamplingParams(1.0, 1e-6, 50))
    np.testing.assert_array_equal(t, np.argmax(logits, -1))


def _host_loop_tokens(e: Engine, prompts, n_new, sampling, seed):
    """Issue #15's baseline: the decode loop as it was (forward step, then ``sample`` with a key split
    on the host, tokens read back every step), for comparing the on-device loop token for token."""
    from m3jax.model import lm_head, text_hidden

    cfg = e.cfg

    @jax.jit
    def forward(params, cache, tokens, positions):
        h, _, cache = text_hidden(params, params["text"]["embed"][tokens][:, None], positions[:, None], cfg, cache,
                                  cache.page_table)
        return lm_head(params, h[:, 0]), cache

    logits = jax.numpy.stack([e.prefill(row, p) for row, p in enumerate(prompts)])
    key, sub = jax.random.split(jax.random.key(seed))
    tokens = sample(logits, sub, sampling)
    positions = np.array([len(p) for p in prompts], np.int32)
    out = [np.asarray(tokens)]
    for _ in range(n_new - 1):
        logits, e.cache = forward(e.params, e.cache, tokens, jax.numpy.asarray(positions))
        positions = positions + 1
        key, sub = jax.random.split(key)
        tokens = sample(logits, sub, sampling)
        out.append(np.asarray(tokens))
    return np.stack(out, axis=1)


def test_on_device_sampling_equals_host_loop_and_stops_one_step_late():
    """The fused step (sampling, positions and key on the device) gives the old host loop's tokens for
    a seed (temperature, top-p and top-k all active); a stop token ends its row there, and the step
    already dispatched for it is discarded."""
    # Shapes and sampling mode of test_batch_of_different_lengths_and_static_decode: compiles are shared.
    cfg = tiny_config(index_block_size=4, index_topk_blocks=2)
    model = m3jax.init_random(cfg, seed=2)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 80, n).tolist() for n in (23, 9, 17)]
    sampling = SamplingParams(0.8, 0.9, 5)
    e = Engine(model.params, cfg, batch=3, capacity=64, prefill_chunk=8)  # generate re-prefills the rows
    want = _host_loop_tokens(e, prompts, 10, sampling, seed=5)
    res = e.generate(prompts, max_new_tokens=10, sampling=sampling, seed=5)
    np.testing.assert_array_equal(np.array(res.generated), want)
    assert res.timings["decode_steps"] == 9 if e.steps_per_call == 1 else 2 * e.steps_per_call  # 2 calls of 8
    # Stop tokens: row 0 stops at the first token that does not occur before it; the other rows run
    # on unless they meet that token too.
    stop_at = next(i for i in range(1, 10) if want[0, i] not in want[0, :i])
    eos = int(want[0, stop_at])
    res = e.generate(prompts, max_new_tokens=10, sampling=sampling, seed=5, eos_ids=(eos,))
    for b in range(3):
        row = want[b].tolist()
        assert res.generated[b] == row[: row.index(eos) + 1 if eos in row else 10], f"row {b}"


def test_steps_per_call_give_the_same_tokens_and_logits():
    """One decode step per call and 4: the same tokens and step logits, greedy and sampled with a
    seed, for 11 new tokens (10 decode steps: the third call of 4 runs 2 steps past the last kept
    token, and the longest row fills the capacity exactly, so those run at positions past the last
    page's last slot), and with a stop token inside a call. (Shapes and modes of
    test_batch_of_different_lengths_and_static_decode: the N=4 programs are shared.)"""
    cfg = tiny_config(index_block_size=4, index_topk_blocks=2)
    model = m3jax.init_random(cfg, seed=2)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 80, n).tolist() for n in (53, 9, 17)]
    engines = {n: Engine(model.params, cfg, batch=3, capacity=64, prefill_chunk=8, decode_steps_per_call=n)
               for n in (1, 4)}
    for sampling in (GREEDY, SamplingParams(0.8, 0.9, 5)):
        res = {n: e.generate(prompts, max_new_tokens=11, sampling=sampling, seed=5, keep_logits=True)
               for n, e in engines.items()}
        assert res[1].timings["decode_steps"] == 10 and res[4].timings["decode_steps"] == 12
        assert res[1].generated == res[4].generated and all(len(g) == 11 for g in res[4].generated)
        np.testing.assert_allclose(np.stack(res[4].step_logits), np.stack(res[1].step_logits), rtol=1e-6, atol=1e-6)
        # Row 1 stops at its 7th token (in the second call of 4); the others run on unless they meet it.
        row = res[1].generated[1]
        eos = row[6] if row[6] not in row[:6] else next(t for t in range(cfg.text.vocab_size) if t not in row[:6])
        stopped = engines[4].generate(prompts, max_new_tokens=11, sampling=sampling, seed=5, eos_ids=(eos,),
                                      keep_logits=True)
        for b, full in enumerate(res[1].generated):
            assert stopped.generated[b] == full[: full.index(eos) + 1 if eos in full else 11], (sampling, b)


def test_decode_loop_reads_each_call_once_and_sends_nothing(monkeypatch):
    """Per call of N steps, the decode loop's only host transfer is the one-call-behind read of its
    tokens (jax.device_get of [B, N] ids; first the prefill's token, [B]): nothing goes
    host-to-device (the transfer guard refuses implicit transfers; on a GPU it also refuses implicit
    device-to-host reads such as np.asarray). Before the loop, generate reads whether each row's
    prefill logits are finite ([B])."""
    cfg = tiny_config(index_block_size=4, index_topk_blocks=2)
    model = m3jax.init_random(cfg, seed=1)
    e = Engine(model.params, cfg, batch=3, capacity=64, prefill_chunk=8)
    reads = []
    device_get = jax.device_get
    monkeypatch.setattr(jax, "device_get", lambda x: reads.append(np.shape(x)) or device_get(x))
    decode = Engine._decode

    def guarded(self, *args):
        with jax.transfer_guard("disallow"):
            return decode(self, *args)

    monkeypatch.setattr(Engine, "_decode", guarded)
    res = e.generate([[1, 2, 3], [4, 5]], max_new_tokens=10, sampling=SamplingParams(0.8, 0.9, 5))
    n = e.steps_per_call
    assert len(res.generated[0]) == 10 and reads == [(3,), (3,)] + [(3, n)] * -(-9 // n)


@pytest.mark.oracle
def test_cli_greedy_contract(oracle_dir, tmp_path):
    fx = np.load(oracle_dir / "text_wide_block" / "fixture.npz")
    out = tmp_path / "out.json"
    prompt = ",".join(str(i) for i in fx["input_ids"][0])
    n = fx["greedy_ids"].shape[1]
    generate.main(["--checkpoint", str(oracle_dir / "text_wide_block"), "--prompt-ids", prompt,
                   "--max-new-tokens", str(n), "--temperature", "0", "--dtype", "float32", "--ctx", "256",
                   "--output-json", str(out), "--quiet"])
    report = json.loads(out.read_text())
    assert report["generated_ids"] == fx["greedy_ids"][0].tolist()
    assert report["prompt_len"] == fx["input_ids"].shape[1]
    assert set(report["timings"]) >= {"load_s", "ttft_s", "prefill_tok_per_s", "decode_ms_per_token"}


def test_cli_default_preset_with_fill(tmp_path):
    out = tmp_path / "out.json"
    report = generate.main(["--ctx", "512", "--fill", "--max-new-tokens", "4", "--prefill-chunk", "256",
                            "--output-json", str(out), "--quiet"])
    assert report["prompt_len"] == 512 - 4 and len(report["generated_ids"]) == 4


def test_cli_refuses_context_over_limit_and_over_memory():
    with pytest.raises(SystemExit, match="max_position_embeddings"):
        generate.main(["--ctx", str(10**7), "--quiet"])
    with pytest.raises(SystemExit, match="refusing to run"):
        generate.main(["--ctx", str(2 * 10**9), "--allow-beyond-max-position", "--quiet"])


def test_prompt_longer_than_capacity_is_an_error():
    cfg = tiny_config()
    model = m3jax.init_random(cfg)
    e = Engine(model.params, cfg, batch=1, capacity=16, prefill_chunk=8)
    with pytest.raises(ValueError, match="capacity"):
        e.generate([list(range(14))], max_new_tokens=4)


def test_key_window_buckets():
    """Prefill key windows cover the chunk's end, hold under twice its keys above the smallest window,
    and take O(log) shapes."""
    floor = eng.MIN_KEY_WINDOW // 16
    for max_pages in (1, 7, 512, 8192, 65536):
        windows = set()
        for need in range(1, max_pages + 1):
            w = eng.key_window_pages(need * 16 - 3, 16, max_pages)
            assert need <= w <= min(max_pages, max(2 * need - 1, 1, floor)), (need, w)
            windows.add(w)
        assert len(windows) <= max(max_pages // floor, 1).bit_length() + 1


def test_key_window_count_for_a_1m_prefill():
    """Distinct compiled prefill shapes (key windows) at m3_width's block of 128: 5 for a 1M-token
    prefill with the CLI's default chunk of 2048 or the benchmark's 4096, 2 at 131K, 1 up to 64K."""
    bs = m3jax.preset("m3_width").text.index_block_size
    for ctx, chunk, count in ((10**6, 2048, 5), (10**6, 4096, 5), (131072, 4096, 2), (65536, 2048, 1)):
        max_pages = -(-ctx // bs)
        windows = {eng.key_window_pages(s + chunk, bs, max_pages) for s in range(0, ctx, chunk)}
        assert len(windows) == count, (ctx, chunk, sorted(windows))


@pytest.mark.parametrize("s_len,q_start,key_block", [(300, 0, 64), (300, 200, 64), (300, 250, 1024), (64, 0, 64)])
def test_causal_attention_equals_dense_mask(s_len, q_start, key_block):
    """The key-blocked online-softmax reference of the full-attention layers equals the one-pass dense
    formulation, including chunks that start mid-context and keys past every query (skipped)."""
    from m3jax import msa
    from m3jax.model import causal_attention

    ks = jax.random.split(jax.random.key(0), 3)
    c = 40
    q = jax.random.normal(ks[0], (2, c, 8, 16))
    k = jax.random.normal(ks[1], (2, s_len, 2, 16))
    v = jax.random.normal(ks[2], (2, s_len, 2, 16))
    pos = np.stack([np.arange(q_start, q_start + c), np.arange(c) + min(q_start, 7)])
    pos = np.minimum(pos, s_len - 1)
    want = msa.dense_mask_attention(q, k, v, None, pos, 4)
    got = causal_attention(q, k, v, pos, key_block=key_block)
    assert rel_l2(got, want) <= 1e-6


def test_memory_plan_m3_width_1m_fits_h200(monkeypatch):
    """The 1M-token run at M3 widths (3 layers, kernels path on the GPU) fits a 139 GiB H200."""
    from m3jax.cache import cache_bytes
    from m3jax.memory import GiB, activation_bytes, weight_bytes

    cfg = m3jax.preset("m3_width").replace(attention_impl="pallas")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    w, c, a = weight_bytes(cfg, 2), cache_bytes(cfg, 1, 10**6), activation_bytes(cfg, 1, 10**6, 4096, 2)
    assert 30 * GiB < w < 36 * GiB  # 2 MoE layers ~14.5 GB each + embed and lm_head 2.5 GB each
    assert 2 * GiB * 3 < c < 7 * GiB  # ~2-2.3 GB per layer
    assert a < 30 * GiB and w + c + a < 100 * GiB


def test_host_memory_counts_page_cache_and_cgroup_limit(tmp_path):
    """The CPU backend's budget is MemAvailable (a host whose free pages are nearly all page cache still
    has room), lowered to what is left under the process's cgroup limit (v2 and v1: its own folder, else
    the mount), where the group's file cache counts as room."""
    from m3jax.memory import host_available_bytes

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:          250000 kB\nMemAvailable:   20000000 kB\n")
    no_proc = str(tmp_path / "no-proc-cgroup")
    host = 20000000 * 1024
    assert host_available_bytes(str(meminfo), str(tmp_path / "no-cgroup"), no_proc) == host
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text("8000000000\n")
    (v2 / "memory.current").write_text("7900000000\n")
    (v2 / "memory.stat").write_text("anon 5000000000\nactive_file 400000000\ninactive_file 500000000\nshmem 7\n")
    assert host_available_bytes(str(meminfo), str(v2), no_proc) == 1000000000
    (v2 / "memory.max").write_text("max\n")
    assert host_available_bytes(str(meminfo), str(v2), no_proc) == host
    # the process's own cgroup folder, named in /proc/self/cgroup, before the mount's
    own = v2 / "job" / "step"
    own.mkdir(parents=True)
    (own / "memory.max").write_text("3000000000\n")
    (own / "memory.current").write_text("2500000000\n")
    (own / "memory.stat").write_text("inactive_file 100000000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/job/step\n")
    assert host_available_bytes(str(meminfo), str(v2), str(proc)) == 600000000
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("4000000000\n")
    (v1 / "memory" / "memory.usage_in_bytes").write_text("3000000000\n")
    (v1 / "memory" / "memory.stat").write_text("cache 9\ntotal_active_file 50000000\ntotal_inactive_file 250000000\n")
    assert host_available_bytes(str(meminfo), str(v1), no_proc) == 1300000000
    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{2**63 - 4096}\n")
    assert host_available_bytes(str(meminfo), str(v1), no_proc) == host
    (v1 / "memory" / "grp").mkdir()  # v1's memory controller line names the process's own folder
    (v1 / "memory" / "grp" / "memory.limit_in_bytes").write_text("2000000000\n")
    (v1 / "memory" / "grp" / "memory.usage_in_bytes").write_text("1900000000\n")
    proc.write_text("5:cpu,cpuacct:/other\n4:memory:/grp\n0::/\n")
    assert host_available_bytes(str(meminfo), str(v1), str(proc)) == 100000000


def test_paged_msa_decode_through_kernels_equals_reference():
    """attention_impl="pallas" decode reads the cache pages in place (decode kernels, GPU interpret mode
    here) through a non-trivial page table; it equals gathering the pages and the jnp reference."""
    from m3jax import msa
    from m3jax.cache import LayerCache
    from m3jax.msa.kernels import decode as _msa_decode_pallas

    cfg = m3jax.preset("m3_width").replace_text(
        num_attention_heads=16, num_key_value_heads=2, head_dim=64, index_n_heads=2, index_head_dim=64,
        index_block_size=64, index_topk_blocks=2).text
    ks = jax.random.split(jax.random.key(0), 5)
    pages, bs = 4, 64
    kv = LayerCache(jax.random.normal(ks[0], (pages, bs, 2, 64)), jax.random.normal(ks[1], (pages, bs, 2, 64)),
                    jax.random.normal(ks[2], (pages, bs, 64)))
    table = jax.numpy.array([[2, 0, 3, 1]], "int32")
    q, iq = jax.random.normal(ks[3], (1, 1, 16, 64)), jax.random.normal(ks[4], (1, 1, 2, 64))
    pos = jax.numpy.array([[200]], "int32")
    o, sel = jax.jit(lambda q, iq, kv: _msa_decode_pallas(q, iq, kv, table, pos, cfg))(q, iq, kv)
    k, v, ik = kv.gather(table)
    want_sel = msa.select_blocks(msa.block_scores(iq, ik, pos, bs), pos, block_size=bs, topk=2)
    np.testing.assert_array_equal(sel, want_sel)
    assert rel_l2(o, msa.sparse_attention(q, k, v, want_sel, pos, bs)) <= 1e-4


def test_sampling_params_refuse_out_of_range_values():
    """Issue #19: a negative temperature sampled the least likely tokens; top_k <= 0 meant no cut."""
    for bad, needle in (((-1.0, 0.95, 40), "temperature"), ((float("inf"), 0.95, 40), "temperature"),
                        ((1.0, 1.5, 40), "top_p"), ((1.0, 0.0, 40), "top_p"), ((1.0, 0.95, 0), "top_k"),
                        ((1.0, 0.95, -3), "top_k"), ((1.0, 0.95, 2.5), "top_k")):
        with pytest.raises(ValueError, match=needle):
            SamplingParams(*bad)


def test_engine_refuses_non_positive_sizes():
    cfg = tiny_config()
    params = m3jax.init_random(cfg).params
    for kw, name in ((dict(batch=0, capacity=16), "batch"), (dict(batch=1, capacity=0), "capacity"),
                     (dict(batch=1, capacity=16, prefill_chunk=-4), "prefill_chunk")):
        with pytest.raises(ValueError, match=f"{name} must be a positive integer"):
            Engine(params, cfg, **kw)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 0"):
        Engine(params, cfg, batch=1, capacity=16, prefill_chunk=8).generate([[1, 2]], max_new_tokens=-1)


class _Loaded(Exception):
    pass


@pytest.mark.parametrize("saved, flag, expected", [
    ("bfloat16", [], "bfloat16"), ("float32", [], "float32"), ("bfloat16", ["--dtype", "float32"], "float32"),
])
def test_cli_dtype_defaults_to_the_checkpoints(tmp_path, monkeypatch, saved, flag, expected):
    """Issue #18: --dtype auto (the default) loads in the checkpoint's own dtype; an explicit one wins."""
    d = m3jax.save_pretrained(m3jax.init_random(tiny_config(vocab_size=300)), tmp_path / "ckpt", dtype=saved)
    seen = {}

    def load(path, dtype, **kw):
        seen["dtype"] = dtype
        raise _Loaded

    monkeypatch.setattr(generate.m3jax, "load_pretrained", load)
    with pytest.raises(_Loaded):
        generate.main(["--checkpoint", str(d), "--prompt-ids", "1,2", "--ctx", "64", "--quiet", *flag])
    assert seen["dtype"] == expected


def test_cli_resolves_attention_impl_once(tmp_path, monkeypatch):
    """Issue #44: generate resolves attention_impl once; load_pretrained takes that config as it is."""
    d = m3jax.save_pretrained(m3jax.init_random(tiny_config(vocab_size=300)), tmp_path / "ckpt")
    calls, seen = [], {}
    real_resolve, real_load = generate.msa_layer.resolve_attention_impl, m3jax.load_pretrained

    def resolve(impl, *a, **kw):
        calls.append(impl)
        return real_resolve(impl, *a, **kw)

    def load(*a, **kw):
        seen["model"] = real_load(*a, **kw)
        raise _Loaded

    monkeypatch.setattr(generate.msa_layer, "resolve_attention_impl", resolve)
    monkeypatch.setattr(m3jax.api, "resolve_attention_impl", resolve)
    monkeypatch.setattr(generate.m3jax, "load_pretrained", load)
    with pytest.raises(_Loaded):
        generate.main(["--checkpoint", str(d), "--prompt-ids", "1,2", "--ctx", "64", "--quiet"])
    assert calls == ["auto"]  # off the GPU: "reference"
    assert seen["model"].config.attention_impl == "reference"
    with pytest.raises(ValueError, match="not both"):
        real_load(d, config=seen["model"].config, attention_impl="pallas", progress=False)


def test_cli_traces_again_when_a_background_canary_fails(monkeypatch):
    # The first run's canaries run beside the load and compile, which presume they pass; one that fails at
    # the warmup's confirm leaves no program, and the config is resolved and the engine built again.
    from m3jax.pallas import verdicts

    argv = ["--config", "m3_tiny", "--prompt-ids", "1,2,3", "--ctx", "64", "--max-new-tokens", "3", "--quiet"]
    plain = generate.main(argv)
    assert plain["timings"]["selfcheck_failed_retraced"] is None and plain["timings"]["selfcheck_canaries_run"] == 0
    failed = verdicts.Verdict("fake@p", "sm_90a", "fake GPU", "fail", 1.0, 2.0, "wrong")

    class Batch:
        seconds, wait_s = 2.0, 0.5

        def confirm(self):
            raise verdicts.CanaryFailed([failed])

        def wait(self):
            return [failed]

    monkeypatch.setattr(generate, "check_kernels_ahead", lambda cfg, wait: Batch())
    calls = []
    real_resolve = generate.msa_layer.resolve_attention_impl
    monkeypatch.setattr(generate.msa_layer, "resolve_attention_impl",
                        lambda impl, *a, **kw: calls.append(impl) or real_resolve(impl, *a, **kw))
    report = generate.main(argv)
    assert calls == ["auto", "auto"]
    t = report["timings"]
    assert t["selfcheck_failed_retraced"] == ["fake@p"] and t["selfcheck_canary_s"] == {"fake@p": 2.0}
    assert t["selfcheck_s"] == 2.0 and t["selfcheck_wait_s"] == 0.5
    assert report["generated_ids"] == plain["generated_ids"]


def test_cli_presets_keep_bfloat16_and_m3_is_an_alias(monkeypatch):
    seen = {}

    def init(cfg, seed, dtype):
        seen["dtype"] = np.dtype(dtype).name
        raise _Loaded

    # generate draws the weights through params.init_random (the config it resolved once, not again).
    monkeypatch.setattr(generate, "init_random", init)
    with pytest.raises(_Loaded):
        generate.main(["--config", "m3_tiny", "--prompt-ids", "1,2", "--ctx", "64", "--quiet"])
    assert seen["dtype"] == "bfloat16"
    # The released width does not fit this machine: refused by the memory plan, not as an unknown preset.
    with pytest.raises(SystemExit, match="refusing to run"):
        generate.main(["--config", "m3", "--ctx", "64", "--quiet"])


@pytest.mark.parametrize("s_len,starts,piece", [(24, (0, 0), 128), (80, (0, 37), 128), (80, (70, 13), 128),
                                                 (61, (37, 50), 128), (80, (0, 37), 16), (80, (70, 13), 7),
                                                 (61, (37, 50), 12), (96, (48, 64), 16)])
def test_chunk_attention_without_mask_equals_reference(s_len, starts, piece):
    """The full-attention layers' split attention (prefix in unmasked pieces and a head with a key length,
    diagonal causal, merged by LSE), through XLA here (cuDNN on the GPU), equals the masked reference:
    chunks at 0 and mid-context, prefixes of no special length, rows of one batch at different starts
    (so with different numbers of pieces), a chunk that runs past the key window (only its rows below S
    are real tokens), and prefixes that are whole pieces (an empty head)."""
    from m3jax.model import causal_attention, cudnn_causal_attention

    ks = jax.random.split(jax.random.key(3), 3)
    c = 24
    q = jax.random.normal(ks[0], (2, c, 8, 16))
    k = jax.random.normal(ks[1], (2, s_len, 2, 16))
    v = jax.random.normal(ks[2], (2, s_len, 2, 16))
    pos = np.array(starts)[:, None] + np.arange(c)
    got = np.asarray(jax.jit(cudnn_causal_attention, static_argnames=("implementation", "piece"))(
        q, k, v, pos, "xla", piece))
    want = np.asarray(jax.jit(causal_attention, static_argnames="key_block")(q, k, v, np.minimum(pos, s_len - 1), 16))
    real = pos < s_len
    assert rel_l2(got[real], want[real]) <= 1e-5


@pytest.mark.parametrize("piece,masks", [(2048, ["CAUSAL", "PADDING"]), (256, ["CAUSAL", "NO_MASK", "PADDING"])])
def test_chunk_attention_lowers_to_unmasked_cudnn_calls(piece, masks):
    """On CUDA the chunk attention is cuDNN flash-attention calls, one CAUSAL (diagonal), one PADDING (the
    prefix's head, a key length) and, where the window holds a whole piece before the chunk, one NO_MASK
    (the prefix's pieces, in a loop), with no dense [C, S] mask operand (lowered here without a GPU; the
    cuDNN version probe is stubbed)."""
    import re
    from unittest import mock

    from jax._src.cudnn import fused_attention_stablehlo as fa

    from m3jax.model import cudnn_causal_attention

    bf16 = jax.numpy.bfloat16
    q = jax.ShapeDtypeStruct((1, 256, 16, 128), bf16)
    k = jax.ShapeDtypeStruct((1, 1024, 2, 128), bf16)
    pos = jax.ShapeDtypeStruct((1, 256), jax.numpy.int32)
    with mock.patch.object(fa, "check_cudnn_version", lambda: 91000):
        text = jax.jit(cudnn_causal_attention, static_argnames="piece").trace(q, k, k, pos, piece=piece).lower(
            lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "custom_call @__cudnn$fmha" in line]
    assert sorted(re.search(r"mask_type\\22: \\22(\w+)", c).group(1) for c in calls) == masks
    assert "1024xbf16" not in "".join(c.split("->")[0] for c in calls if "CAUSAL" in c)  # diagonal: C keys only
    assert not any("256x1024" in c for c in calls)  # no [C, S] bias


def test_cli_compile_cache_second_run_hits(tmp_path, monkeypatch):
    """The CLI writes every executable to the persistent cache (M3JAX_CACHE_DIR here) and the engine's
    programs, exported, to its aot/ folder; a second run, with the in-memory caches cleared as in a
    new process, reads the programs back (no trace) and compiles nothing. The previous JAX settings
    come back after each run; --no-compile-cache turns both off and leaves the settings alone."""
    monkeypatch.setenv("M3JAX_CACHE_DIR", str(tmp_path / "cache"))
    argv = ["--config", "m3_tiny", "--prompt-ids", "1,2,3", "--ctx", "64", "--max-new-tokens", "3",
            "--temperature", "0", "--quiet"]
    jax.clear_caches()
    aot.clear()
    first = generate.main(argv)["compile_cache"]
    assert first["dir"] == str(tmp_path / "cache") and first["misses"] > 0 and any((tmp_path / "cache").iterdir())
    # the prefill, chunk embedding, first-token and decode programs
    assert first["aot"] == {"dir": str(tmp_path / "cache" / "aot"), "hits": 0, "misses": 4, "uncached": 0}
    assert jax.config.jax_compilation_cache_dir is None
    jax.clear_caches()
    aot.clear()
    second = generate.main(argv)["compile_cache"]
    assert second["hits"] >= first["misses"] and second["misses"] == 0, second
    assert second["aot"]["hits"] == 4 and second["aot"]["misses"] == 0, second
    off = generate.main([*argv, "--no-compile-cache"])["compile_cache"]
    assert off == {"dir": None, "hits": 0, "misses": 0, "aot": {"dir": None, "hits": 0, "misses": 0, "uncached": 0}}


def test_chunk_attention_refuses_gradients():
    """The parts' LSEs carry no gradient on either backend, so differentiating the merge is refused."""
    from m3jax.model import cudnn_causal_attention

    q = k = v = jax.numpy.ones((1, 8, 2, 8))
    pos = jax.numpy.arange(8)[None]
    # Under jit the refusal comes while tracing: eagerly, every op of the forward compiled on its own first.
    with pytest.raises(NotImplementedError, match="forward only"):
        jax.jit(jax.grad(lambda q: cudnn_causal_attention(q, k, v, pos, implementation="xla").sum()))(q)


def test_dense_decode_reads_pages_in_place():
    """A full-attention layer's decode on the kernels path reads its K/V pages in place (the paged
    decode attention kernel over every block up to the token's; GPU interpret mode here) through a
    non-trivial page table, rows at different positions; it equals gathering the pages and the
    reference causal attention."""
    from m3jax.cache import LayerCache
    from m3jax.model import causal_attention
    from m3jax.msa.kernels import dense_decode

    cfg = m3jax.preset("m3_width").replace_text(
        num_attention_heads=16, num_key_value_heads=2, head_dim=64, index_n_heads=2, index_head_dim=64,
        index_block_size=64).text
    ks = jax.random.split(jax.random.key(1), 3)
    kv = LayerCache(jax.random.normal(ks[0], (8, 64, 2, 64)), jax.random.normal(ks[1], (8, 64, 2, 64)), None)
    table = jax.numpy.array([[2, 0, 3, 1], [5, 7, 4, 6]], "int32")
    q = jax.random.normal(ks[2], (2, 1, 16, 64))
    pos = jax.numpy.array([[200], [70]], "int32")
    got = jax.jit(lambda q, kv: dense_decode(q, kv, table, pos, cfg))(q, kv)
    k, v, _ = kv.gather(table)
    assert rel_l2(got, causal_attention(q, k, v, pos)) <= 1e-4
