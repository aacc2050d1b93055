"""DeepSeek-V4.1's image tower: the ViT, the aligner and the learned span delimiters.

    tower = VisionTower(config.vision, weights, accelerator, dtype, device)  # release-named tensors
    rows = tower.span_embeddings(preprocess_image(image, config.vision))     # [num_tokens, hidden]

ViT (`vision.*`): a linear patch embedding with bias (3 * patch^2 -> width), then pre-norm blocks
`x += wo(attn(norm1(x)))`, `x += w2(silu(gate) * up)` with `gate, up = w1(norm2(x))` halves, and a
final `vision.norm`. Attention is bidirectional over the patches of one image (SDPA, default
scale), `wqkv` and `wo` with bias, on a half-split 2-D rotary embedding: each head's first half is
rotated against its second half by angles `[row * f, col * f]` with f = theta^-(2j / (head_dim/2))
(rows first, then columns), in fp32. The RMSNorms compute in fp32 with fp32 weights (eps 1e-6).

Aligner (`aligner.*`): the final states as a `[width, patch_h, patch_w]` map, zero-padded at the
bottom and right up to multiples of `downsample_ratio` (after the final norm, so the pads are exact
zeros), unfolded into one row per `r x r` cell in reading order (each row channel-major: c, dy,
dx), then `w2(gelu(w1(row)))` with exact GELU, into the text model's width.

Span (`image_start`, `image_newline`, `image_end`): the learned vectors at START, NEWLINE and END;
the IMAGE positions take the aligner's rows in order (image_processing.py: the layout).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.accelerator.interface import Accelerator
from deepinfer.models.common.weights import WeightUses
from deepinfer.models.deepseek_v41.image_processing import (
    END, IMAGE, NEWLINE, START, ImageGrid, ProcessedImage, span_roles,
)
from deepinfer.models.deepseek_v41.vision_config import VisionConfig

DELIMITERS = ("image_start", "image_newline", "image_end")
VISION_PREFIXES = ("vision.", "aligner.") + DELIMITERS


def is_vision_weight(name: str) -> bool:
    """Whether an official tensor name belongs to the image tower (ViT, aligner or a delimiter)."""
    return name.startswith(VISION_PREFIXES)


def vision_weight_shapes(vision: VisionConfig, hidden_size: int) -> dict[str, tuple[int, ...]]:
    """Official name -> shape of every tower tensor (the release: 266 of them)."""
    W, I, r = vision.hidden_size, vision.intermediate_size, vision.downsample_ratio
    shapes: dict[str, tuple[int, ...]] = {"vision.patch_embed.proj.weight": (W, vision.patch_dim),
                                          "vision.patch_embed.proj.bias": (W,)}
    for i in range(vision.num_hidden_layers):
        b = f"vision.blocks.{i}."
        shapes.update({b + "norm1.weight": (W,), b + "norm2.weight": (W,),
                       b + "attn.wqkv.weight": (3 * W, W), b + "attn.wqkv.bias": (3 * W,),
                       b + "attn.wo.weight": (W, W), b + "attn.wo.bias": (W,),
                       b + "mlp.w1.weight": (2 * I, W), b + "mlp.w2.weight": (W, I)})
    shapes.update({"vision.norm.weight": (W,),
                   "aligner.w1.weight": (hidden_size, W * r * r), "aligner.w1.bias": (hidden_size,),
                   "aligner.w2.weight": (hidden_size, hidden_size), "aligner.w2.bias": (hidden_size,)})
    shapes.update({name: (hidden_size,) for name in DELIMITERS})
    return shapes


def is_vision_norm(name: str) -> bool:
    """The tower's RMSNorm weights, kept in fp32 whatever the model dtype."""
    return name.startswith("vision.") and name.endswith(("norm1.weight", "norm2.weight", "vision.norm.weight"))


def rotary_tables(patch_h: int, patch_w: int, head_dim: int, theta: float, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos, sin `[patches, 1, head_dim / 2]` of the half-split 2-D rotary embedding: per patch
    (row-major), the row's angles then the column's."""
    half = head_dim // 2
    freq = theta ** -(torch.arange(0, half, 2, dtype=torch.float32, device=device) / half)  # [half / 2]
    rows = torch.arange(patch_h, device=device, dtype=torch.float32).repeat_interleave(patch_w)
    cols = torch.arange(patch_w, device=device, dtype=torch.float32).repeat(patch_h)
    angles = torch.cat([rows[:, None] * freq, cols[:, None] * freq], dim=-1).unsqueeze(1)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[patches, heads, head_dim]` with its first half rotated against its second, in fp32."""
    a, b = x.float().chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)


class VisionTower:
    """The ViT, the aligner and the span delimiters over release-named tensors (module docstring)."""

    def __init__(self, config: VisionConfig, weights: dict[str, torch.Tensor], accelerator: Accelerator,
                 dtype: torch.dtype, device: torch.device | str):
        self.config, self.accel, self.dtype, self.device = config, accelerator, dtype, torch.device(device)
        hidden = weights["aligner.w2.weight"].shape[0]
        missing = sorted(set(vision_weight_shapes(config, hidden)) - set(weights))
        if missing:
            raise ValueError(f"the vision tower needs {len(missing)} more tensors (e.g. {missing[0]!r}); load the "
                             f"checkpoint with deepinfer.models.deepseek_v41.checkpoint")
        self.w = {name: self._convert(name, t) for name, t in weights.items() if is_vision_weight(name)}

    def weight_uses(self) -> WeightUses:
        """The projections (every matrix but the norms'), read by `linear`."""
        for name, t in self.w.items():
            if name.endswith(".weight") and t.dim() == 2 and not is_vision_norm(name):
                yield "linear", t

    def _convert(self, name: str, t: torch.Tensor) -> torch.Tensor:
        dtype = torch.float32 if is_vision_norm(name) else self.dtype
        out = t.to(device=self.device, dtype=dtype)
        return out.clone() if out.data_ptr() == t.data_ptr() else out.contiguous()

    # ----- pieces -----
    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        y = self.accel.linear(x, self.w[f"{name}.weight"])
        bias = self.w.get(f"{name}.bias")
        return y if bias is None else y + bias

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return (self.w[name] * y).to(x.dtype)

    def _attention(self, x: torch.Tensor, prefix: str, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n, heads = x.shape[0], self.config.num_attention_heads
        q, k, v = (t.view(n, heads, -1) for t in self._linear(x, prefix + "wqkv").chunk(3, dim=-1))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        # 4-D [1, heads, n, d]: torch's fused (flash) CPU kernel takes only batched inputs; 3-D ones
        # fall back to the math path, which holds every [heads, n, n] score (10.6 GB for the
        # release tower's 16 heads at 8,649 patches, a 1344x1344 image) and runs about 5x slower
        out = F.scaled_dot_product_attention(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)))[0]
        return self._linear(out.transpose(0, 1).reshape(n, -1), prefix + "wo")

    def _mlp(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        gate, up = self._linear(x, prefix + "w1").chunk(2, dim=-1)
        return self._linear(F.silu(gate) * up, prefix + "w2")

    # ----- the tower -----
    @torch.no_grad()
    def vit(self, patches: torch.Tensor, grid: ImageGrid) -> torch.Tensor:
        """Final ViT states `[patches, width]` of one image's patches `[patches, 3 * patch^2]`."""
        if patches.shape != (grid.num_patches, self.config.patch_dim):
            raise ValueError(f"expected patches of shape {(grid.num_patches, self.config.patch_dim)} for a "
                             f"{grid.patch_h}x{grid.patch_w} patch grid, got {tuple(patches.shape)}")
        x = self._linear(patches.to(device=self.device, dtype=self.dtype), "vision.patch_embed.proj")
        cos, sin = rotary_tables(grid.patch_h, grid.patch_w, self.config.head_dim, self.config.rope_theta,
                                 self.device)
        for i in range(self.config.num_hidden_layers):
            b = f"vision.blocks.{i}."
            x = x + self._attention(self._norm(x, b + "norm1.weight"), b + "attn.", cos, sin)
            x = x + self._mlp(self._norm(x, b + "norm2.weight"), b + "mlp.")
        return self._norm(x, "vision.norm.weight")

    @torch.no_grad()
    def align(self, states: torch.Tensor, grid: ImageGrid) -> torch.Tensor:
        """The aligner's rows `[n_h * n_w, hidden]` (reading order) of the final ViT states."""
        r = self.config.downsample_ratio
        fmap = states.view(grid.patch_h, grid.patch_w, -1).permute(2, 0, 1)
        fmap = F.pad(fmap, (0, -grid.patch_w % r, 0, -grid.patch_h % r))  # zeros: after the final norm
        cells = F.unfold(fmap.unsqueeze(0), r, stride=r).squeeze(0).transpose(0, 1)  # [cells, width * r * r]
        return self._linear(F.gelu(self._linear(cells.contiguous(), "aligner.w1")), "aligner.w2")

    @torch.no_grad()
    def span_embeddings(self, image: ProcessedImage) -> torch.Tensor:
        """`[num_tokens, hidden]` in the model dtype: the embeddings of the image's whole span."""
        grid = image.grid
        rows = self.align(self.vit(image.patches, grid), grid)
        roles = span_roles(grid).to(self.device)
        span = torch.empty((grid.num_tokens, rows.shape[-1]), dtype=self.dtype, device=self.device)
        span[roles == IMAGE] = rows.to(self.dtype)
        for role, name in ((START, "image_start"), (NEWLINE, "image_newline"), (END, "image_end")):
            span[roles == role] = self.w[name]
        return span
