"""PyTorch definitions of the zoo architectures that no installed library provides.

Written from the papers' and reference implementations' structure (nothing is downloaded):

* :func:`yolo_v8n`: a YOLOv8-n detector (CSP backbone with C2f blocks, SPPF, PAN neck, the
  decoupled head) without the box decoding: ``Split``/``Concat`` everywhere, SiLU activations;
* :func:`sd_unet_block`: one Stable-Diffusion U-Net block: a ResBlock (GroupNorm, SiLU, the
  timestep embedding added) and a spatial transformer (GroupNorm, self-attention,
  cross-attention to a text context, GEGLU feed-forward).

torch is imported by the builders, never at module import.
"""

from __future__ import annotations

__all__ = ["sd_unet_block", "yolo_v8n"]


def yolo_v8n(width: float = 0.25, depth: float = 0.34, classes: int = 80):
    """YOLOv8 (n scale by default) up to the raw head outputs: per level the box distribution
    (4 x 16 bins) and the class logits, concatenated over the three levels (B, 64+classes, N)."""
    import torch
    from torch import nn

    def ch(c):
        return max(16, int(c * width) // 8 * 8)

    def n(k):
        return max(1, round(k * depth))

    class Conv(nn.Sequential):
        def __init__(self, cin, cout, k=1, s=1):
            super().__init__(nn.Conv2d(cin, cout, k, s, k // 2, bias=False),
                             nn.BatchNorm2d(cout), nn.SiLU())

    class Bottleneck(nn.Module):
        def __init__(self, c, shortcut=True):
            super().__init__()
            self.cv1, self.cv2, self.add = Conv(c, c, 3), Conv(c, c, 3), shortcut

        def forward(self, x):
            y = self.cv2(self.cv1(x))
            return x + y if self.add else y

    class C2f(nn.Module):
        def __init__(self, cin, cout, blocks, shortcut=True):
            super().__init__()
            self.c = cout // 2
            self.cv1 = Conv(cin, 2 * self.c)
            self.cv2 = Conv((2 + blocks) * self.c, cout)
            self.m = nn.ModuleList(Bottleneck(self.c, shortcut) for _ in range(blocks))

        def forward(self, x):
            y = list(self.cv1(x).split((self.c, self.c), 1))
            for block in self.m:
                y.append(block(y[-1]))
            return self.cv2(torch.cat(y, 1))

    class SPPF(nn.Module):
        def __init__(self, cin, cout):
            super().__init__()
            hidden = cin // 2
            self.cv1, self.cv2 = Conv(cin, hidden), Conv(hidden * 4, cout)
            self.pool = nn.MaxPool2d(5, 1, 2)

        def forward(self, x):
            y = [self.cv1(x)]
            for _ in range(3):
                y.append(self.pool(y[-1]))
            return self.cv2(torch.cat(y, 1))

    class Detect(nn.Module):
        def __init__(self, chans):
            super().__init__()
            c2, c3 = max(16, chans[0] // 4, 64), max(chans[0], min(classes, 100))
            self.box = nn.ModuleList(nn.Sequential(Conv(c, c2, 3), Conv(c2, c2, 3),
                                                   nn.Conv2d(c2, 64, 1)) for c in chans)
            self.cls = nn.ModuleList(nn.Sequential(Conv(c, c3, 3), Conv(c3, c3, 3),
                                                   nn.Conv2d(c3, classes, 1)) for c in chans)

        def forward(self, feats):
            outs = [torch.cat((b(f), c(f)), 1).flatten(2)
                    for f, b, c in zip(feats, self.box, self.cls, strict=True)]
            return torch.cat(outs, 2)

    class YOLOv8(nn.Module):
        def __init__(self):
            super().__init__()
            c = [ch(64), ch(128), ch(256), ch(512), ch(1024)]
            self.stem = nn.Sequential(Conv(3, c[0], 3, 2), Conv(c[0], c[1], 3, 2),
                                      C2f(c[1], c[1], n(3)))
            self.p3 = nn.Sequential(Conv(c[1], c[2], 3, 2), C2f(c[2], c[2], n(6)))
            self.p4 = nn.Sequential(Conv(c[2], c[3], 3, 2), C2f(c[3], c[3], n(6)))
            self.p5 = nn.Sequential(Conv(c[3], c[4], 3, 2), C2f(c[4], c[4], n(3)),
                                    SPPF(c[4], c[4]))
            self.up = nn.Upsample(scale_factor=2, mode="nearest")
            self.n4 = C2f(c[4] + c[3], c[3], n(3), shortcut=False)
            self.n3 = C2f(c[3] + c[2], c[2], n(3), shortcut=False)
            self.d3 = Conv(c[2], c[2], 3, 2)
            self.m4 = C2f(c[2] + c[3], c[3], n(3), shortcut=False)
            self.d4 = Conv(c[3], c[3], 3, 2)
            self.m5 = C2f(c[3] + c[4], c[4], n(3), shortcut=False)
            self.detect = Detect((c[2], c[3], c[4]))

        def forward(self, x):
            p3 = self.p3(self.stem(x))
            p4 = self.p4(p3)
            p5 = self.p5(p4)
            n4 = self.n4(torch.cat((self.up(p5), p4), 1))
            n3 = self.n3(torch.cat((self.up(n4), p3), 1))
            m4 = self.m4(torch.cat((self.d3(n3), n4), 1))
            m5 = self.m5(torch.cat((self.d4(m4), p5), 1))
            return self.detect([n3, m4, m5])

    return YOLOv8()


def sd_unet_block(channels: int = 320, context_dim: int = 768, heads: int = 8,
                  time_dim: int = 1280, groups: int = 32):
    """A Stable-Diffusion 1.x U-Net block at the first resolution: ResBlock then spatial
    transformer; inputs ``(latent, timestep embedding, text context)``."""
    import torch
    from torch import nn

    class ResBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = nn.GroupNorm(groups, channels), nn.GroupNorm(groups, channels)
            self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
            self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
            self.emb = nn.Linear(time_dim, channels)

        def forward(self, x, temb):
            h = self.conv1(nn.functional.silu(self.norm1(x)))
            h = h + self.emb(nn.functional.silu(temb))[:, :, None, None]
            h = self.conv2(nn.functional.silu(self.norm2(h)))
            return x + h

    class Attention(nn.Module):
        def __init__(self, kv_dim):
            super().__init__()
            self.q = nn.Linear(channels, channels, bias=False)
            self.k = nn.Linear(kv_dim, channels, bias=False)
            self.v = nn.Linear(kv_dim, channels, bias=False)
            self.out = nn.Linear(channels, channels)

        def forward(self, x, context):
            b, n, c = x.shape
            d = c // heads
            q = self.q(x).view(b, n, heads, d).transpose(1, 2)
            k = self.k(context).view(b, -1, heads, d).transpose(1, 2)
            v = self.v(context).view(b, -1, heads, d).transpose(1, 2)
            weights = torch.softmax(q @ k.transpose(-1, -2) * d ** -0.5, dim=-1)
            return self.out((weights @ v).transpose(1, 2).reshape(b, n, c))

    class GEGLU(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(channels, channels * 8)
            self.out = nn.Linear(channels * 4, channels)

        def forward(self, x):
            h, gate = self.proj(x).chunk(2, dim=-1)
            return self.out(h * nn.functional.gelu(gate))

    class SpatialTransformer(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.GroupNorm(groups, channels, eps=1e-6)
            self.proj_in = nn.Conv2d(channels, channels, 1)
            self.ln1, self.ln2, self.ln3 = (nn.LayerNorm(channels) for _ in range(3))
            self.self_attn, self.cross_attn = Attention(channels), Attention(context_dim)
            self.ff = GEGLU()
            self.proj_out = nn.Conv2d(channels, channels, 1)

        def forward(self, x, context):
            b, c, h, w = x.shape
            t = self.proj_in(self.norm(x)).flatten(2).transpose(1, 2)
            n1 = self.ln1(t)
            t = t + self.self_attn(n1, n1)
            t = t + self.cross_attn(self.ln2(t), context)
            t = t + self.ff(self.ln3(t))
            return x + self.proj_out(t.transpose(1, 2).reshape(b, c, h, w))

    class UNetBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.res, self.transformer = ResBlock(), SpatialTransformer()

        def forward(self, latent, temb, context):
            return self.transformer(self.res(latent, temb), context)

    return UNetBlock()
