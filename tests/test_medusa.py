"""Medusa heads: published layouts load to the same logits as our own heads, artifacts round-trip, bad input is
refused clearly, tree choices from measured accuracies, and the lossy typical-acceptance rule."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import SpecConfig
from specjax.drafters import medusa
from specjax.drafters.base import target_weight
from specjax.drafters.registry import BuildRequest, build as build_drafter
from specjax.trees import MEDUSA_63, choices_from_accuracies
from specjax.verify import chain_typical_lossy, typical_threshold
from layouts import write_medusa_repo_layout, write_vllm_medusa_layout
from tiny import ragged_prompts, tiny_model


def random_heads(target, num_heads=3, num_layers=2, layout="per_head", seed=0, scale=0.3):
    p = medusa.init_heads(None, num_heads, num_layers, target_weight(target.params, "lm_head"), layout)
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    p = dict(p, w=scale * jax.random.normal(k1, p["w"].shape), b=scale * jax.random.normal(k2, p["b"].shape))
    if layout != "target_head":                       # target_head heads project through the target's LM head
        p["proj"] = p["proj"] + 0.1 * jax.random.normal(k3, p["proj"].shape)
    return medusa.MedusaHeads(num_heads, num_layers, layout, p, "random")


def reference_logits(heads: medusa.MedusaHeads, hidden: np.ndarray, lm_head=None) -> np.ndarray:
    """The Medusa repository's head, written out in numpy: x + SiLU(x W^T + b) per ResBlock, then the LM head
    (lm_head: the target's, for target_head heads)."""
    p = jax.tree_util.tree_map(np.asarray, heads.params)
    out = []
    for i in range(heads.num_heads):
        x = hidden.astype(np.float64)
        for r in range(heads.num_layers):
            z = x @ p["w"][i, r] + p["b"][i, r]
            x = x + z / (1 + np.exp(-z))
        proj = (p["proj"][i] if heads.layout == "per_head" else
                np.asarray(lm_head) if heads.layout == "target_head" else p["proj"])
        out.append(x @ proj)
    return np.stack(out, axis=-2)


@pytest.mark.parametrize("layout", ["medusa_repo", "medusa_repo_pt", "vllm"])
def test_published_layouts_give_our_logits(tmp_path, target, layout):
    heads = random_heads(target)
    path = str(tmp_path / layout)
    if layout == "vllm":
        write_vllm_medusa_layout(path, heads, target)
    else:
        write_medusa_repo_layout(path, heads, target, torch_file=layout.endswith("_pt"))
    loaded = medusa.load_heads(path, target)
    assert (loaded.num_heads, loaded.num_layers, loaded.layout) == (3, 2, "per_head")
    hidden = np.random.default_rng(0).normal(size=(5, target.config.hidden_size)).astype(np.float32)
    ours = np.asarray(medusa.head_logits(heads.params, jnp.asarray(hidden)))
    np.testing.assert_allclose(np.asarray(medusa.head_logits(loaded.params, jnp.asarray(hidden))), ours, atol=1e-5)
    np.testing.assert_allclose(ours, reference_logits(heads, hidden), rtol=1e-4, atol=1e-4)
    # and it drafts through generate() like our own heads
    prompts = ragged_prompts(2, seed=2)
    cfg = SpecConfig(method="medusa", num_speculative_tokens=3, max_new_tokens=8)
    assert specjax.generate(target, prompts, cfg, drafter=path).tokens == \
        specjax.generate(target, prompts, cfg, drafter=heads).tokens


@pytest.mark.parametrize("layout", ["per_head", "shared", "target_head"])
def test_artifact_round_trip(tmp_path, target, layout):
    heads = random_heads(target, layout=layout)
    medusa.save_heads(str(tmp_path / "h"), heads, target, "# test heads\n", dtype="float32")
    loaded = medusa.load_heads(str(tmp_path / "h"), target)
    assert loaded.layout == layout and sorted(loaded.params) == sorted(heads.params)
    assert ("proj" in loaded.params) == (layout != "target_head")      # target_head ships no projection
    for k in heads.params:
        np.testing.assert_array_equal(np.asarray(loaded.params[k]), np.asarray(heads.params[k]))
    hidden = jnp.ones((2, target.config.hidden_size))
    lm_head = target_weight(target.params, "lm_head")
    np.testing.assert_allclose(medusa.head_logits(loaded.params, hidden, lm_head),
                               reference_logits(heads, np.ones((2, 32)), lm_head), rtol=1e-4, atol=1e-4)
    if layout == "target_head":
        with pytest.raises(ValueError, match="through the target's LM head: pass lm_head"):
            medusa.head_logits(loaded.params, hidden)
        prompts = [[1, 2, 3, 4, 1, 2]]
        cfg = SpecConfig(method="medusa", num_speculative_tokens=3, max_new_tokens=12)
        assert specjax.generate(target, prompts, cfg, drafter=str(tmp_path / "h")).tokens == \
            specjax.generate(target, prompts, SpecConfig(max_new_tokens=12)).tokens


@pytest.mark.parametrize("layout", ["per_head", "shared", "target_head"])
def test_loop_runs_only_the_heads_it_drafts(target, layout):
    """Heads past the proposal's depth are cut when the drafter is built (each would cost a vocabulary product per
    step for drafts no one reads); the heads kept are the first ones, unchanged, and decoding stays exact."""
    heads = random_heads(target, num_heads=4, layout=layout)
    prompts = ragged_prompts(2, seed=3)
    for cfg, depth in ((SpecConfig(method="medusa", num_speculative_tokens=2, max_new_tokens=10), 2),
                       (SpecConfig(method="medusa", num_speculative_tokens=4, max_new_tokens=10), 4),
                       (SpecConfig(method="medusa", tree_choices=((0,), (1,), (0, 0), (0, 0, 0)), max_new_tokens=10),
                        3)):
        drafter, params = build_drafter(BuildRequest(cfg, target, heads, prompts, 64))
        assert drafter.num_heads == depth and params["w"].shape[0] == params["b"].shape[0] == depth
        for key in params:
            cut = heads.params[key][:depth] if key != "proj" or layout == "per_head" else heads.params[key]
            np.testing.assert_array_equal(np.asarray(params[key]), np.asarray(cut))
        assert specjax.generate(target, prompts, cfg, drafter=heads).tokens == \
            specjax.generate(target, prompts, SpecConfig(max_new_tokens=10)).tokens


def test_bad_input(tmp_path, target):
    heads = random_heads(target, num_heads=3)
    prompts = [[1, 2, 3]]
    with pytest.raises(ValueError, match="k=4 but the Medusa heads 'random' have only 3 heads"):
        specjax.generate(target, prompts, SpecConfig(method="medusa", num_speculative_tokens=4), drafter=heads)
    with pytest.raises(ValueError, match="tree is 4 deep but the Medusa heads 'random' have only 3"):
        specjax.generate(target, prompts, SpecConfig(method="medusa", tree_choices=MEDUSA_63), drafter=heads)
    with pytest.raises(ValueError, match="the dynamic tree searches 4 depths but the Medusa heads 'random' have "
                                         "only 3"):
        specjax.generate(target, prompts, SpecConfig(method="medusa", num_steps=4, topk=2, num_draft_tokens=6),
                         drafter=heads)
    with pytest.raises(ValueError, match="malformed tree_choices"):
        SpecConfig(method="medusa", tree_choices=[(0,), (1, 1)])
    with pytest.raises(TypeError, match="method='medusa' needs drafter"):
        specjax.generate(target, prompts, SpecConfig(method="medusa", num_speculative_tokens=2), drafter=None)
    # heads for another target: ours (artifact records the target) and a published layout (config sizes)
    medusa.save_heads(str(tmp_path / "ours"), heads, target, "# x\n", dtype="float32")
    wide = tiny_model(0, hidden=48, heads=4, kv_heads=2)
    with pytest.raises(ValueError, match="trained for another target.*hidden_size"):
        medusa.load_heads(str(tmp_path / "ours"), wide)
    write_medusa_repo_layout(str(tmp_path / "pub"), heads, target)
    with pytest.raises(ValueError, match="trained for hidden_size=32, the target has 48"):
        medusa.load_heads(str(tmp_path / "pub"), wide)
    other_vocab = tiny_model(0, vocab=67)
    with pytest.raises(ValueError, match="trained for vocab_size=61, the target has 67"):
        medusa.load_heads(str(tmp_path / "pub"), other_vocab)
    with pytest.raises(ValueError, match="vocab 61"):
        specjax.generate(other_vocab, prompts, SpecConfig(method="medusa", num_speculative_tokens=2), drafter=heads)
    # truncated checkpoints
    st = tmp_path / "pub" / "medusa_lm_head.safetensors"
    st.write_bytes(st.read_bytes()[:-100])
    with pytest.raises(ValueError, match="truncated"):
        medusa.load_heads(str(tmp_path / "pub"), target)
    w = tmp_path / "ours" / "model.safetensors"
    w.write_bytes(w.read_bytes()[:-100])
    with pytest.raises(ValueError, match="truncated"):
        medusa.load_heads(str(tmp_path / "ours"), target)
    # a published file missing one head's tensors
    from safetensors.numpy import load_file, save_file
    write_medusa_repo_layout(str(tmp_path / "pub2"), heads, target)
    f = str(tmp_path / "pub2" / "medusa_lm_head.safetensors")
    sd = load_file(f)
    del sd["2.2.weight"]
    save_file(sd, f)
    with pytest.raises(ValueError, match="missing tensor '2.2.weight'"):
        medusa.load_heads(str(tmp_path / "pub2"), target)


def test_choices_from_accuracies_is_optimal():
    acc = [[0.6, 0.2, 0.1], [0.5, 0.2], [0.4, 0.3]]
    for n in (1, 3, 6, 9):
        choices = choices_from_accuracies(acc, n)
        value = lambda c: np.prod([acc[d][r] for d, r in enumerate(c)])
        best = 0.0                                   # brute force over ancestor-closed sets of n nodes
        nodes = [c for d in range(1, 4) for c in itertools.product(*[range(len(acc[i])) for i in range(d)])]
        for subset in itertools.combinations(nodes, n):
            if all(c[:-1] in subset or len(c) == 1 for c in subset):
                best = max(best, sum(map(value, subset)))
        assert abs(sum(map(value, choices)) - best) < 1e-12
    with pytest.raises(ValueError):
        choices_from_accuracies([[1.5]], 2)


def test_typical_acceptance_rule():
    """LOSSY rule: accept while p(draft) > min(eps, delta * exp(-H(p)))."""
    p = jnp.array([[[0.7, 0.2, 0.1], [0.34, 0.33, 0.33], [0.9, 0.05, 0.05]]])      # [1, 3, 3]
    H = -np.sum(np.asarray(p) * np.log(np.asarray(p)), -1)
    thr = np.minimum(0.09, 0.3 * np.exp(-H))
    np.testing.assert_allclose(typical_threshold(p, 0.09, 0.3), thr, rtol=1e-6)
    # draft 1 (p=0.2 > thr) accepted, draft 2 (token 2: 0.33 > thr) accepted -> n=2, next sampled from p[2]
    n, nxt = chain_typical_lossy(jax.random.PRNGKey(0)[None], jnp.array([[1, 2]]), p, 0.09, 0.3)
    assert int(n[0]) == 2 and 0 <= int(nxt[0]) < 3
    low = jnp.array([[[0.96, 0.02, 0.02], [0.34, 0.33, 0.33], [0.9, 0.05, 0.05]]])   # 0.02 < thr: rejected
    n, _ = chain_typical_lossy(jax.random.PRNGKey(0)[None], jnp.array([[1, 2]]), low, 0.09, 0.3)
    assert int(n[0]) == 0
    with pytest.raises(ValueError, match="only apply to acceptance_method='typical_lossy'"):
        SpecConfig(method="medusa", num_speculative_tokens=2, posterior_threshold=0.2)
    with pytest.raises(ValueError, match="acceptance_method must be"):
        SpecConfig(method="medusa", num_speculative_tokens=2, acceptance_method="typical")


def test_head_labels_are_what_verification_accepts(target):
    """Soft-label training terms and held-out accuracy score a head against the target's own argmax for the token
    it drafts: on the target's greedy rows that is the row's token (so the hard-label count agrees exactly), and on
    rows some other process wrote it is not (a Medusa-2 target that moved from the original)."""
    from train.losses.common import frozen_target_features
    from train.losses.common import labeled
    from train.losses.medusa import medusa_accuracy, medusa_terms
    heads = random_heads(target, num_heads=3, num_layers=1, layout="shared", seed=3, scale=0.5)
    prompts = [[5, 9, 2, 7], [11, 3, 8, 1]]
    out = specjax.generate(target, prompts, SpecConfig(method="none", max_new_tokens=20))
    greedy_rows = jnp.asarray([p + list(t) for p, t in zip(prompts, out.tokens)], jnp.int32)   # [2, 24]
    first_label = len(prompts[0])
    inputs = greedy_rows[:, :-1]
    frozen = frozen_target_features(target.params, target.config, inputs)
    _, _, acc_soft = medusa_terms(heads.params, frozen.hidden, labeled(greedy_rows, first_label), 0.8, frozen.logits)
    _, _, acc_hard = medusa_terms(heads.params, frozen.hidden, labeled(greedy_rows, first_label), 0.8)
    np.testing.assert_allclose(np.asarray(acc_soft), np.asarray(acc_hard), atol=1e-6)
    hits, counts = medusa_accuracy(heads.params, target.params, target.config, greedy_rows, first_label, 3)
    np.testing.assert_allclose(np.asarray(hits[:, 0] / counts), np.asarray(acc_hard), atol=1e-6)

    # Rows that are not the target's greedy text: the labels are the target's argmax, recomputed directly here.
    rows = jnp.asarray(np.random.default_rng(0).integers(0, target.config.vocab_size, (2, 24)), jnp.int32)
    frozen = frozen_target_features(target.params, target.config, rows[:, :-1])
    head_top = np.asarray(jnp.argmax(medusa.head_logits(heads.params, frozen.hidden), -1))        # [B, T, K]
    target_top = np.asarray(jnp.argmax(frozen.logits, -1))                                      # [B, T]
    T = rows.shape[1] - 1
    for i in range(3):
        ts = [t for t in range(T) if first_label <= t + i + 2 <= T]
        want = np.mean([head_top[b, t, i] == target_top[b, t + i + 1] for b in range(2) for t in ts])
        off_by_one = np.mean([head_top[b, t, i] == target_top[b, t + i] for b in range(2) for t in ts])
        assert want != off_by_one          # these rows tell a shifted label apart, so the checks below can fail
        hits, counts = medusa_accuracy(heads.params, target.params, target.config, rows, first_label, 1)
        assert abs(float(hits[i, 0] / counts[i]) - want) < 1e-6
        _, _, acc = medusa_terms(heads.params, frozen.hidden, labeled(rows, first_label), 0.8, frozen.logits)
        assert abs(float(acc[i]) - want) < 1e-6


@pytest.mark.parametrize("soft_labels", [True, False])
def test_label_window_gives_the_full_loss_and_gradient(target, soft_labels):
    """Medusa-1's loss over the positions its labels can reach (label_window: a chat row's answer, not the batch's
    width) equals the loss over every position, value and gradient, on rows whose spans start near the front and
    end at the batch's edge; a window one position short of what head K - 1 reads changes it (the check can fail)."""
    from train.data import LabeledRows
    from train.losses.common import max_label_span
    from train.losses.medusa import medusa_loss_fn
    rng = np.random.default_rng(1)
    B, W, K = 4, 48, 3
    first = np.array([1, 5, 20, 30], np.int32)
    end = np.array([14, 25, 36, W], np.int32)                 # the last row's span runs to the batch's edge
    tokens = rng.integers(1, target.config.vocab_size, (B, W)).astype(np.int32)
    tokens[np.arange(W)[None, :] >= end[:, None]] = 0
    rows = jax.tree.map(jnp.asarray, LabeledRows(tokens, first, end))
    heads = random_heads(target, num_heads=K, num_layers=1, layout="target_head", seed=4, scale=0.5).params
    span = max_label_span(rows)
    assert span + K < W - 1                                   # the window is narrower than the inputs
    full = medusa_loss_fn(target.config, 0.8, 0, soft_labels=soft_labels)
    windowed = medusa_loss_fn(target.config, 0.8, 0, soft_labels=soft_labels, max_span=span)
    short = medusa_loss_fn(target.config, 0.8, 0, soft_labels=soft_labels, max_span=span - 1)
    key = jax.random.PRNGKey(0)
    (a, ma), ga = jax.value_and_grad(full, has_aux=True)(heads, rows, key, target.params)
    (b, mb), gb = jax.value_and_grad(windowed, has_aux=True)(heads, rows, key, target.params)
    np.testing.assert_allclose(float(b), float(a), rtol=1e-5)
    for name in ma:
        np.testing.assert_allclose(float(mb[name]), float(ma[name]), rtol=1e-5, atol=1e-6, err_msg=name)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-4, atol=1e-6), ga, gb)
    c, _ = short(heads, rows, key, target.params)
    assert abs(float(c) - float(a)) > 1e-4 * abs(float(a))
