"""PEFT's merge made to go wrong as merges have gone wrong, for the tests that merge_2048.py's check fails each (the main
suite's tests/test_merge.py and the Unsloth tier's): the experts' LoRA lost (unsloth-zoo issue 885), every LoRA scaled
by alpha / sqrt(r) instead of alpha / r (rsLoRA's scale for LoRA's), one module left out of the merge."""

FAULTS = ["experts' LoRA lost", "rsLoRA's scale", "q_proj of layer 1 dropped"]
# What merge_2048's ERROR line names for each: the tensors the fault leaves wrong.
NAMED = {"experts' LoRA lost": "mlp.experts.", "rsLoRA's scale": "self_attn.",
         "q_proj of layer 1 dropped": "model.layers.1.self_attn.q_proj.weight"}  # fmt: skip


def break_merge(monkeypatch, fault: str) -> None:
    from peft.tuners.lora import layer
    from peft.tuners.lora.model import LoraModel

    if fault == "experts' LoRA lost":  # PEFT's LoRA on the fused expert tensors: both presets' experts, once mapped
        monkeypatch.setattr(layer.ParamWrapper, "merge", lambda self, *args, **kwargs: None)
    elif fault == "rsLoRA's scale":  # r = 4: twice the change
        for cls in (layer.Linear, layer.ParamWrapper):
            delta = cls.get_delta_weight
            monkeypatch.setattr(cls, "get_delta_weight", lambda self, name, *a, _d=delta, **k: 2 * _d(self, name, *a, **k))
    else:
        merge_and_unload = LoraModel.merge_and_unload

        def without_one(self, *args, **kwargs):
            self.model.model.layers[1].self_attn.q_proj.lora_B["default"].weight.data.zero_()
            return merge_and_unload(self, *args, **kwargs)

        monkeypatch.setattr(LoraModel, "merge_and_unload", without_one)


# Merges wrong in ways only the checkpoint's own files show (tests/test_merge.py): a tensor no adapter touches left out
# of the save, which the float32 comparison would catch on reload but the weights' judge must catch alone; a NaN in a
# merged weight, which passes every `<`/`>` comparison.
HOLES = {"a tensor left out": "model.norm.weight is missing", "a NaN weight": "model.layers.0.self_attn.q_proj.weight"}


def break_save(monkeypatch, hole: str) -> None:
    import torch
    from peft.tuners.lora.model import LoraModel
    from transformers import PreTrainedModel

    if hole == "a tensor left out":
        save = PreTrainedModel.save_pretrained

        def without_norm(self, *args, **kwargs):
            kwargs["state_dict"] = {k: v for k, v in self.state_dict().items() if k != "model.norm.weight"}
            return save(self, *args, **kwargs)

        monkeypatch.setattr(PreTrainedModel, "save_pretrained", without_norm)
    else:
        merge_and_unload = LoraModel.merge_and_unload

        def with_nan(self, *args, **kwargs):
            merged = merge_and_unload(self, *args, **kwargs)
            with torch.no_grad():
                merged.model.layers[0].self_attn.q_proj.weight[0, 0] = float("nan")
            return merged

        monkeypatch.setattr(LoraModel, "merge_and_unload", with_nan)
