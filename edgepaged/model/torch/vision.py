"""A vision model's tower on the torch runner's device (the GPU path of issue 68): the towers of
`model/vision.py` (SigLIP, CLIP, Qwen2.5-VL's windowed ViT and merger) in torch, from the same
file's weights, with the same math (float32; attention by `scaled_dot_product_attention`).

    runner.attach_vision(mmproj)           # ModelRunner: its VisionEncoder's tower is one of these

Each stands in for the numpy tower where `VisionEncoder` calls it (`tower(pixels, pause)`, or
`tower(pixels, grid, pause)` for Qwen2.5-VL) and returns numpy float32, so the families'
projectors after the tower (pixel shuffle, Gemma 3's pool, LLaVA's MLP) run as on the CPU:
a few products over a few hundred rows. `pause()` is called between layers, as the numpy
towers do (the encoder's work in pieces beside interactive prompts).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ..vision import QWEN25VL, QwenVisionTower, read_vision


def _weights(path, device) -> tuple[str, dict, dict]:
    kind, hp, w = read_vision(path)
    return kind, hp, {k: torch.from_numpy(np.array(v, np.float32)).to(device) for k, v in w.items()}


def _gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


def _quick_gelu(x):
    return x * torch.sigmoid(1.702 * x)


class TorchSiglip:
    """SigLIP (and CLIP, `clip=True`: a class token, a LayerNorm before the layers, quick-GELU,
    no final norm, the class token dropped) over whole tiles [N, 3, S, S] -> [N, P, hidden]."""

    def __init__(self, numpy_tower, path, device, clip: bool = False):
        _, _, w = _weights(path, device)
        self.w, self.device, self.clip = w, device, clip
        self.layers, self.heads, self.patch, self.eps = (numpy_tower.layers, numpy_tower.heads, numpy_tower.patch,
                                                         numpy_tower.eps)
        self.hidden = numpy_tower.hidden
        self.math = "exact"
        self.act = _quick_gelu if clip else _gelu_tanh

    def __call__(self, pixels: np.ndarray, pause=None) -> np.ndarray:
        w, step = self.w, pause or (lambda: None)
        with torch.inference_mode():
            px = torch.from_numpy(np.ascontiguousarray(pixels, np.float32)).to(self.device)
            x = F.conv2d(px, w["embeddings.patch_embedding.weight"], w.get("embeddings.patch_embedding.bias"),
                         stride=self.patch).flatten(2).transpose(1, 2)          # [N, P, hidden]
            if self.clip:
                cls = w["embeddings.class_embedding"].reshape(1, 1, -1).expand(len(x), 1, -1)
                x = torch.cat([cls, x], 1)
            x = x + w["embeddings.position_embedding.weight"][: x.shape[1]]
            if self.clip:
                x = F.layer_norm(x, (self.hidden,), w["pre_layrnorm.weight"], w["pre_layrnorm.bias"], self.eps)
            for i in range(self.layers):
                step()
                x = self._layer(x, f"encoder.layers.{i}.")
            if self.clip:
                x = x[:, 1:]
            elif "post_layernorm.weight" in w:
                x = F.layer_norm(x, (self.hidden,), w["post_layernorm.weight"], w["post_layernorm.bias"], self.eps)
            return x.float().cpu().numpy()

    def _layer(self, x, p: str):
        w, h = self.w, self.hidden
        n, t, _ = x.shape
        a = p + "self_attn."
        y = F.layer_norm(x, (h,), w[p + "layer_norm1.weight"], w[p + "layer_norm1.bias"], self.eps)
        q, k, v = (F.linear(y, w[a + f"{s}_proj.weight"], w[a + f"{s}_proj.bias"])
                   .view(n, t, self.heads, -1).transpose(1, 2) for s in "qkv")
        o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, t, h)
        x = x + F.linear(o, w[a + "out_proj.weight"], w[a + "out_proj.bias"])
        y = F.layer_norm(x, (h,), w[p + "layer_norm2.weight"], w[p + "layer_norm2.bias"], self.eps)
        y = self.act(F.linear(y, w[p + "mlp.fc1.weight"], w[p + "mlp.fc1.bias"]))
        return x + F.linear(y, w[p + "mlp.fc2.weight"], w[p + "mlp.fc2.bias"])


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class TorchQwenTower:
    """Qwen2.5-VL's windowed ViT and merger (`vision.QwenVisionTower`'s math): pixels
    [gh * gw, 3 * 2 * p * p] and the grid -> feature rows [(gh / 2) * (gw / 2), text hidden]."""

    def __init__(self, numpy_tower: QwenVisionTower, path, device):
        _, _, w = _weights(path, device)
        t = numpy_tower
        self.np, self.w, self.device = t, w, device
        self.layers, self.heads, self.patch, self.merge, self.eps = t.layers, t.heads, t.patch, t.merge, t.eps
        self.hidden, self.width, self.full, self.math = t.hidden, t.width, t.full, "exact"
        conv = w["embeddings.patch_embedding.weight"]
        if conv.dim() == 5:
            conv = conv.sum(2)
        elif "embeddings.patch_embedding.weight_1" in w:
            conv = conv + w["embeddings.patch_embedding.weight_1"]
        self.conv = conv.reshape(self.hidden, -1)
        self.inv_freq = torch.from_numpy(t.inv_freq).to(device)

    def __call__(self, pixels: np.ndarray, grid: tuple[int, int], pause=None) -> np.ndarray:
        w, step = self.w, pause or (lambda: None)
        gh, gw = grid
        n, mm = gh * gw, self.merge * self.merge
        units, cu, hw = self.np.order(gh, gw)
        perm = (units[:, None] * mm + np.arange(mm)).reshape(-1)
        dev = self.device
        with torch.inference_mode():
            px = torch.from_numpy(np.ascontiguousarray(pixels, np.float32)).to(dev)
            x = px.view(n, 3, -1, self.patch * self.patch)[:, :, 0].reshape(n, -1) @ self.conv.T
            perm_t = torch.from_numpy(perm).to(dev)
            x = x[perm_t]
            pos = torch.from_numpy(hw[perm]).to(dev).float()
            ang = torch.cat([pos[:, :1] * self.inv_freq, pos[:, 1:] * self.inv_freq], 1)
            cos, sin = ang.cos()[:, None], ang.sin()[:, None]
            window = torch.from_numpy(np.repeat(np.arange(len(cu) - 1), np.diff(cu))).to(dev)
            mask = window[:, None] == window[None, :]            # attention inside each window
            for i in range(self.layers):
                step()
                x = self._block(x, f"encoder.layers.{i}.", cos, sin, None if i in self.full else mask)
            step()
            y = _rms(x, w["post_layernorm.weight"], 1e-6).reshape(n // mm, -1)
            y = F.gelu(F.linear(y, w["projector.linear_1.weight"], w["projector.linear_1.bias"]))
            y = F.linear(y, w["projector.linear_2.weight"], w["projector.linear_2.bias"])
            out = torch.empty_like(y)
            out[torch.from_numpy(units).to(dev)] = y
            return out.float().cpu().numpy()

    def _block(self, x, p: str, cos, sin, mask):
        w, t = self.w, len(x)
        a = p + "self_attn."
        y = _rms(x, w[p + "layer_norm1.weight"], self.eps)
        q, k, v = (F.linear(y, w[a + f"{s}_proj.weight"], w[a + f"{s}_proj.bias"]).view(t, self.heads, -1)
                   for s in "qkv")

        def rotate(z):               # the rotary pairs (j, j + d / 2)
            z1, z2 = z.chunk(2, -1)
            return torch.cat([z1 * cos - z2 * sin, z2 * cos + z1 * sin], -1)
        q, k, v = rotate(q).transpose(0, 1), rotate(k).transpose(0, 1), v.transpose(0, 1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(0, 1).reshape(t, self.hidden)
        x = x + F.linear(o, w[a + "out_proj.weight"], w[a + "out_proj.bias"])
        y = _rms(x, w[p + "layer_norm2.weight"], self.eps)
        g = F.silu(F.linear(y, w[p + "mlp.gate.weight"], w[p + "mlp.gate.bias"]))
        g = g * F.linear(y, w[p + "mlp.fc1.weight"], w[p + "mlp.fc1.bias"])
        return x + F.linear(g, w[p + "mlp.fc2.weight"], w[p + "mlp.fc2.bias"])


def torch_tower(enc, device):
    """`enc`'s tower (a VisionEncoder's) on `device`."""
    if enc.kind == QWEN25VL:
        return TorchQwenTower(enc.tower, enc.path, device)
    return TorchSiglip(enc.tower, enc.path, device, clip=enc.kind == "mlp")
