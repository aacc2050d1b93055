"""Draw the two sample images of the examples (ours: drawn here with Pillow, no photograph or
third-party picture involved), so anyone can regenerate them exactly:

    python examples/images/draw_images.py          # writes lighthouse.jpeg and shapes.png beside this file

* `lighthouse.jpeg` (640x426): a red-and-white lighthouse on a rocky shore at sunset, sea and a
  gradient sky with a sun; a scene to describe.
* `shapes.png` (480x480): three red circles, two blue squares and one yellow triangle on white;
  something to count.

Everything is drawn from fixed numbers (no randomness), so the files are the same on every run
with the same Pillow version.
"""
from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _lerp(a: tuple[int, ...], b: tuple[int, ...], t: float) -> tuple[int, ...]:
    return tuple(round(x + (y - x) * t) for x, y in zip(a, b))


def lighthouse():
    from PIL import Image, ImageDraw

    w, h = 640, 426
    horizon = 270
    img = Image.new("RGB", (w, h))
    d = ImageDraw.Draw(img)
    for y in range(horizon):  # sky: deep blue at the top to orange at the horizon
        d.line([(0, y), (w, y)], fill=_lerp((40, 60, 140), (250, 160, 80), y / horizon))
    d.ellipse([430, 170, 530, 270], fill=(255, 220, 120))  # the sun, half set
    for y in range(horizon, h):  # sea: dark blue, lighter near the horizon
        d.line([(0, y), (w, y)], fill=_lerp((70, 90, 150), (20, 40, 90), (y - horizon) / (h - horizon)))
    for i in range(12):  # the sun's reflection on the water
        y = horizon + 6 + i * 12
        half = 40 - i * 3
        d.line([(480 - half, y), (480 + half, y)], fill=(250, 190, 110), width=3)
    d.polygon([(0, 300), (60, 250), (150, 245), (230, 280), (260, h), (0, h)], fill=(60, 50, 45))  # rocks
    d.polygon([(20, 300), (70, 262), (130, 258), (190, 290), (150, 310)], fill=(90, 75, 65))
    left, right, top, base = 95, 145, 95, 255  # the tower: tapering, red and white bands
    bands = 6
    for i in range(bands):
        y0 = top + (base - top) * i / bands
        y1 = top + (base - top) * (i + 1) / bands
        inset0 = 10 * (1 - i / bands)
        inset1 = 10 * (1 - (i + 1) / bands)
        d.polygon([(left + inset0, y0), (right - inset0, y0), (right - inset1, y1), (left + inset1, y1)],
                  fill=(200, 30, 30) if i % 2 == 0 else (245, 245, 240))
    d.rectangle([100, 70, 140, 95], fill=(255, 240, 150), outline=(30, 30, 30), width=2)  # the lamp room
    d.polygon([(95, 70), (120, 50), (145, 70)], fill=(30, 30, 30))  # the roof
    d.polygon([(140, 82), (330, 40), (330, 124)], fill=(255, 245, 190))  # the beam
    return img


def shapes():
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (480, 480), (255, 255, 255))
    d = ImageDraw.Draw(img)
    red, blue, yellow, outline = (220, 40, 40), (40, 80, 210), (240, 200, 30), (20, 20, 20)
    for x, y in [(90, 100), (240, 90), (380, 130)]:
        d.ellipse([x - 50, y - 50, x + 50, y + 50], fill=red, outline=outline, width=3)
    for x, y in [(100, 300), (260, 340)]:
        d.rectangle([x - 55, y - 55, x + 55, y + 55], fill=blue, outline=outline, width=3)
    d.polygon([(400, 260), (460, 400), (340, 400)], fill=yellow, outline=outline, width=3)
    return img


def main(out_dir: Path = HERE) -> list[Path]:
    out_dir = Path(out_dir)
    jpeg, png = out_dir / "lighthouse.jpeg", out_dir / "shapes.png"
    lighthouse().save(jpeg, quality=85, optimize=True)
    shapes().save(png, optimize=True)
    return [jpeg, png]


if __name__ == "__main__":
    for path in main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE):
        print(f"wrote {path} ({path.stat().st_size:,} bytes)")
