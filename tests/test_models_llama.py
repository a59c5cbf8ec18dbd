import torch

from fxpar.models.llama import Llama, LlamaConfig, hf_llama_plan, llama_plan


def _model(**kw) -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig(**kw))


def test_forward_shape():
    model = _model()
    tokens = torch.randint(0, 256, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, 256)
    assert torch.isfinite(logits).all()


def test_causal():
    model = _model()
    tokens = torch.randint(0, 256, (1, 12))
    full = model(tokens)
    prefix = model(tokens[:, :5])
    torch.testing.assert_close(full[:, :5], prefix)


def test_module_paths_and_plan():
    model = _model()
    names = dict(model.named_modules())
    for path in list(llama_plan()):
        assert path.replace("*", "0") in names
    for path in ("embed", "norm", "lm_head", "layers.1.attn_norm", "layers.1.mlp_norm"):
        assert path in names
    assert "rope_cos" not in model.state_dict()
    assert model.rope_cos.shape == (64, 16)
    assert len(hf_llama_plan()) == 7
    assert all(k.startswith("model.layers.*.") for k in hf_llama_plan())


def test_export():
    model = _model()
    tokens = torch.randint(0, 256, (2, 16))
    ep = torch.export.export(model, (tokens,), strict=False)
    torch.testing.assert_close(ep.module()(tokens), model(tokens))


def test_tie_embeddings():
    tied = _model(tie_embeddings=True)
    assert tied.lm_head.weight is tied.embed.weight
    assert len(list(tied.parameters())) == len(list(_model().parameters())) - 1
    untied = _model()
    assert untied.lm_head.weight is not untied.embed.weight
