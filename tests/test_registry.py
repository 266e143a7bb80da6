"""The drafter registry, the target-exposure contract, drafter artifacts, and clear errors at the API edge."""
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import SpecConfig, checkpoints
from specjax.drafters import artifacts, registry
from specjax.drafters.base import Draft, last_tokens
from specjax.drafters.registry import DrafterSpec, Option
from specjax.models.llama import lm_head, rms_norm
from tiny import ragged_prompts, tiny_model


def test_every_builtin_method_is_registered():
    assert {"none", "draft_model", "ngram", "predicted"} <= set(registry.methods())
    assert "draft_model" in registry.tree_methods() and "ngram" not in registry.tree_methods()
    with pytest.raises(ValueError, match="unknown speculative method 'medusa_typo'.*draft_model"):
        registry.resolve(SpecConfig(method="medusa_typo", num_speculative_tokens=2))
    for bad in ("", None, 3):
        with pytest.raises(ValueError, match="method must be the name of a speculative method"):
            SpecConfig(method=bad)


def test_fields_a_method_does_not_read_are_refused():
    with pytest.raises(ValueError, match="prompt_lookup_min is not used by method='draft_model'"):
        registry.resolve(SpecConfig(method="draft_model", num_speculative_tokens=2, prompt_lookup_min=2))
    with pytest.raises(ValueError, match="method='ngram' cannot draft token trees"):
        registry.resolve(SpecConfig(method="ngram", num_steps=2, topk=2, num_draft_tokens=3))
    with pytest.raises(ValueError, match="has no option 'window'"):
        registry.resolve(SpecConfig(method="ngram", num_speculative_tokens=2, drafter_options={"window": 3}))


def test_the_method_is_checked_by_resolve_and_by_generate_at_the_latest(target):
    """SpecConfig checks what holds whatever the method (it imports no drafter); what depends on the method is
    registry.resolve's, which generate() and prepare() run first: the same message, from generate()."""
    unread = SpecConfig(method="draft_model", num_speculative_tokens=2, prompt_lookup_min=2)      # constructs
    for bad, match in ((SpecConfig(method="medusa_typo", num_speculative_tokens=2), "unknown speculative method"),
                       (unread, "prompt_lookup_min is not used by method='draft_model'"),
                       (SpecConfig(method="ngram"), r"num_speculative_tokens \(k\) must be an int in \[1, 64\]"),
                       (SpecConfig(method="ngram", num_speculative_tokens=2, drafter_options={"window": 3}),
                        "has no option 'window'")):
        with pytest.raises(ValueError, match=match):
            specjax.generate(target, [[1, 2, 3]], bad)
        with pytest.raises(ValueError, match=match):
            specjax.prepare(target, [[1, 2, 3]], bad)
    with pytest.raises(ValueError, match="unknown speculative method"):
        specjax.generate(target, [[1, 2, 3]], {"method": "medusa_typo", "num_speculative_tokens": 2})
    with pytest.raises(TypeError, match="resolve\\(\\) takes a SpecConfig"):
        registry.resolve({"method": "ngram"})


def test_resolve_completes_the_config():
    """Every declared option with its default, k derived where the options fix it, the method's default
    verify_widths; a resolved config resolves to itself and equal input resolves to equal (hashable) configs,
    the compiled loop's static argument."""
    given = SpecConfig(method="lookahead", drafter_options={"window_size": 5})
    done = registry.resolve(given)
    assert done.drafter_options == (("guess_set_size", 4), ("ngram_size", 3), ("window_size", 5))
    assert done.num_speculative_tokens == done.k == (5 + 4) * (3 - 1) and done.option("ngram_size") == 3
    assert registry.resolve(done) == done
    again = registry.resolve(SpecConfig(method="lookahead", drafter_options=(("window_size", 5),)))
    assert again == done and hash(again) == hash(done)
    suffix = registry.resolve(SpecConfig(method="suffix", num_speculative_tokens=8))
    assert suffix.verify_widths == (1, 2, 4) and suffix.option("suffix_decoding_max_tree_depth") == 24
    plain = SpecConfig(max_new_tokens=3)
    assert registry.resolve(plain) == plain and plain.k == 0
    # before resolving: k and the options the config does not hold are the registry's to give
    with pytest.raises(ValueError, match=r"k is the method's to derive.*registry\.resolve"):
        given.k
    with pytest.raises(KeyError, match=r"no drafter option 'ngram_size'.*registry\.resolve"):
        given.option("ngram_size")
    assert given.option("window_size") == 5
    with pytest.raises(KeyError, match="no drafter option 'nope'"):
        done.option("nope")


# ---- a drafter defined here, outside the package: options and the target-exposure contract ---------------------

SEEN = []          # what the drafter saw inside the compiled loop, sent to the host by jax.debug.callback


@dataclasses.dataclass(frozen=True)
class _ProbeDrafter:
    """Proposes copies of the last token; checks, inside the loop, that the exposed layers and weights are the
    target's: rms_norm(last layer) @ lm_head must reproduce the target's logits at every verified node (and at the
    prefill's last prompt position, the one it computes logits for)."""
    k: int
    target_layers: tuple = (1, 0)           # out of order on purpose: they come back in the declared order
    target_weights: tuple = ("lm_head", "final_norm")
    eps: float = 1e-5

    def _check(self, ctx, out, where):
        w = ctx.target_weights
        rebuilt = lm_head({"lm_head": w["lm_head"]}, rms_norm(out.layer_hidden[0], w["final_norm"], self.eps))
        if where == "prefill":          # the prefill's logits are its last prompt position's only
            rebuilt = jnp.take_along_axis(rebuilt, (ctx.prompt_length - 1)[:, None, None], axis=1)
        err = jnp.max(jnp.abs(rebuilt - out.logits))
        shapes = tuple(x.shape for x in out.layer_hidden)
        jax.debug.callback(lambda e: SEEN.append((where, shapes, float(e))), err)

    def init(self, params, ctx, target_out, sp):
        self._check(ctx, target_out, "prefill")
        return ()

    def propose(self, params, state, ctx, keys, sp):
        return Draft(jnp.repeat(last_tokens(ctx, 1), self.k, axis=1)), state

    def commit(self, params, state, ctx, num_accepted, target_out, verified):
        self._check(ctx, verified.out, "verify")
        return state


def _build_probe(req):
    return _ProbeDrafter(req.config.k, eps=req.config.option("eps")), ()


@pytest.fixture
def probe_method():
    registry.register(DrafterSpec("probe", _build_probe, options={
        "eps": Option(1e-5, lambda v: isinstance(v, float) and v > 0, "the target's rms_norm_eps, a float > 0")}),
        replace=True)
    yield "probe"
    registry.unregister("probe")


def test_target_exposure_reaches_the_drafter(target, probe_method):
    with pytest.raises(ValueError, match="drafter option eps=-1.0.*a float > 0"):
        registry.resolve(SpecConfig(method=probe_method, num_speculative_tokens=2, drafter_options={"eps": -1.0}))
    cfg = SpecConfig(method=probe_method, num_speculative_tokens=2, max_new_tokens=6,
                     drafter_options={"eps": target.config.rms_norm_eps})
    assert cfg.option("eps") == target.config.rms_norm_eps
    SEEN.clear()
    prompts = ragged_prompts(3, seed=3)
    res = specjax.generate(target, prompts, cfg)
    jax.effects_barrier()
    assert res.tokens == specjax.generate(target, prompts, SpecConfig(max_new_tokens=6)).tokens
    wheres = {w for w, _, _ in SEEN}
    assert wheres == {"prefill", "verify"}
    H = target.config.hidden_size
    for where, shapes, err in SEEN:
        assert len(shapes) == 2 and all(s[0] == 3 and s[-1] == H for s in shapes)
        if where == "verify":
            assert all(s[1] == 3 for s in shapes)          # k + 1 verified positions
        assert err < 1e-4, (where, err)


@dataclasses.dataclass(frozen=True)
class _UndeclaredDrafter:
    k: int                                  # no target_layers / target_weights


def test_a_drafter_must_declare_what_it_reads(target):
    registry.register(DrafterSpec("undeclared", lambda req: (_UndeclaredDrafter(req.config.k), ())), replace=True)
    try:
        with pytest.raises(TypeError, match=r"_UndeclaredDrafter that method='undeclared' builds does not declare "
                                            r"\['target_layers', 'target_weights'\]"):
            specjax.generate(target, [[1, 2, 3]], SpecConfig(method="undeclared", num_speculative_tokens=2))
    finally:
        registry.unregister("undeclared")


def test_forward_layer_order_and_range(target):
    from specjax.cache import KVCache
    from specjax.models.llama import forward
    cfg = target.config
    cache = KVCache.init(cfg.num_layers, 1, 8, cfg.num_kv_heads, cfg.head_dim)
    toks = jnp.array([[1, 2, 3]], jnp.int32)
    a = forward(target.params, cfg, toks, cache, hidden_layers=(1, 0)).layer_hidden
    b = forward(target.params, cfg, toks, cache, hidden_layers=(0, 1)).layer_hidden
    np.testing.assert_array_equal(a[0], b[1])
    with pytest.raises(ValueError, match=r"hidden_layers \[5\] out of range: the model has 2 decoder layers"):
        forward(target.params, cfg, toks, cache, hidden_layers=(5,))


# ---- drafter= as a loaded artifact, a directory or a shipped name ---------------------------------------------

def test_drafter_by_shipped_name_directory_and_model():
    target = specjax.load_model("stdlib-target")
    draft = specjax.load_model("stdlib-draft")
    prompts = ["def add(a, b):\n"]
    cfg = SpecConfig(method="draft_model", num_speculative_tokens=3, max_new_tokens=12)
    loaded = specjax.generate(target, prompts, cfg, drafter=draft)
    by_name = specjax.generate(target, prompts, cfg, drafter="stdlib-draft")
    by_path = specjax.generate(target, prompts, cfg, drafter=os.path.join(checkpoints.resolve("stdlib-draft", "model")))
    assert loaded.tokens == by_name.tokens == by_path.tokens
    assert loaded.stats["accepted"] == by_name.stats["accepted"]
    with pytest.raises(FileNotFoundError, match="no model directory 'no-such-draft'"):
        specjax.generate(target, prompts, cfg, drafter="no-such-draft")


# ---- bad input at the API edge: clear errors, never internal ones ---------------------------------------------

def test_bad_generate_inputs(target):
    with pytest.raises(ValueError, match="no prompts"):
        specjax.generate(target, [])
    with pytest.raises(TypeError, match="prompts must be a list.*got None"):
        specjax.generate(target, None)
    with pytest.raises(TypeError, match="prompt 1 must be a string, a list of token ids or a list of chat messages"):
        specjax.generate(target, [[1, 2], 3.5])
    with pytest.raises(ValueError, match="config has unknown fields \\['k'\\]"):
        specjax.generate(target, [[1, 2]], {"method": "ngram", "k": 2})
    with pytest.raises(TypeError, match="config must be a SpecConfig"):
        specjax.generate(target, [[1, 2]], "ngram")
    with pytest.raises(TypeError, match="model must be a specjax Model"):
        specjax.generate(target.params, [[1, 2]])
    with pytest.raises(ValueError, match="takes no drafter"):
        specjax.generate(target, [[1, 2]], SpecConfig(method="ngram", num_speculative_tokens=2), drafter="x")
    # a dict config works like the SpecConfig it names
    res = specjax.generate(target, [[1, 2, 3]], {"method": "ngram", "num_speculative_tokens": 2,
                                                 "max_new_tokens": 4})
    assert len(res.tokens[0]) == 4


# ---- drafter artifacts: one directory convention, checked against the target ----------------------------------

def test_artifact_round_trip_and_target_checks(tmp_path, target):
    tensors = {"heads.0.w": np.arange(12, dtype=np.float32).reshape(3, 4), "heads.0.b": np.ones(4, np.float32)}
    path = tmp_path / "heads"
    artifacts.save_artifact(path, "medusa", {"num_heads": 1}, tensors, target, "# test\n", dtype="float32")
    cfg, loaded = artifacts.load_artifact(path, target, "medusa")
    assert cfg == {"num_heads": 1}
    for name, a in tensors.items():
        np.testing.assert_array_equal(loaded[name], a)
    with pytest.raises(ValueError, match="holds a 'medusa' drafter, not a 'eagle' one"):
        artifacts.load_artifact(path, target, "eagle")
    other = tiny_model(0, hidden=48, heads=4, kv_heads=2)
    with pytest.raises(ValueError, match="trained for another target.*hidden_size: trained for 32, this target has 48"):
        artifacts.load_artifact(path, other, "medusa")
    other_vocab = tiny_model(0, vocab=67)
    with pytest.raises(ValueError, match="vocab_size: trained for 61, this target has 67"):
        artifacts.load_artifact(path, other_vocab, "medusa")
    weights = path / artifacts.WEIGHTS_NAME
    weights.write_bytes(weights.read_bytes()[:-8])
    with pytest.raises(ValueError, match="truncated"):
        artifacts.load_artifact(path, target, "medusa")
    os.remove(path / artifacts.MANIFEST_NAME)
    with pytest.raises(FileNotFoundError, match="has no MANIFEST.md"):
        artifacts.load_artifact(path, target, "medusa")
    with pytest.raises(FileNotFoundError, match="no drafter directory"):
        artifacts.load_artifact(tmp_path / "missing", target, "medusa")


def test_artifact_vocab_hash_distinguishes_tokenizers():
    target = specjax.load_model("stdlib-target")
    recorded = artifacts.target_fingerprint(target)
    assert recorded["vocab_sha256"] == artifacts.vocab_hash(specjax.load_model("stdlib-draft"))
    with pytest.raises(ValueError, match="vocab_sha256"):
        artifacts.check_target(dict(recorded, vocab_sha256="0" * 64), target, "x")


def test_output_head_is_the_targets_own_head_in_its_stored_form():
    """target_weight(..., "output_head"): the head as the target stores it (tied: the embedding itself, never its
    transpose, which a kernel call would copy whole; untied: the LM head), cut to the logical vocabulary like the
    others; through llama.lm_head it gives the target's own logits."""
    from specjax.drafters.base import target_weight
    model = tiny_model(0)
    cfg = model.config
    tied = {k: v for k, v in model.params.items() if k != "lm_head"}
    head = target_weight(tied, "output_head")
    assert set(head) == {"embed"} and head["embed"] is tied["embed"]
    untied = dict(tied, lm_head=jnp.asarray(np.random.default_rng(0).standard_normal(
        (cfg.hidden_size, cfg.vocab_size + 3)), jnp.float32))             # a vocabulary padded for a mesh
    head = target_weight(untied, "output_head", cfg.vocab_size)
    assert set(head) == {"lm_head"} and head["lm_head"].shape == (cfg.hidden_size, cfg.vocab_size)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, cfg.hidden_size)), jnp.float32)
    for params in (tied, untied):
        want = x @ target_weight(params, "lm_head", cfg.vocab_size)
        got = lm_head(target_weight(params, "output_head", cfg.vocab_size), x)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
