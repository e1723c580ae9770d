"""Image keys: near-duplicate collisions and re-encoding keep rates, for each mode, in one run.

Run from the repository root::

    python -m bench.image_keys            # full: 20 photos, ~250 near-duplicates, ~800 distinct
    python -m bench.image_keys --quick    # 6 photos, ~80 near-duplicates, fewer candidates

An image key may be used as the default only if it meets BOTH numbers (docs/image_keys.md;
issue 13): 0 colliding pairs on the near-duplicate set (``bench.near_duplicates``: text with one
character changed at several sizes, fonts and positions; a small object added; a small region
recoloured; a small object moved; on ``skimage.data`` photos and synthetic scenes at several
sizes: pictures a vision model tells apart), and >= 95% of re-encodings keeping their key.

Images are scikit-image's bundled natural photos (``skimage.data``; no download) and generated
pictures. For each photo (saved as PNG: the original) the re-encodings are JPEG q60/70/80/90/95,
resizes by -10/-5% (Lanczos) and +5/+10% (bicubic) saved as PNG, PNG->JPEG (Pillow's default
q75), JPEG(q85)->PNG, a second JPEG generation (q75 twice), WEBP q80, a PNG with an EXIF block, a
JPEG q95 with an EXIF block, the same JPEG with the EXIF segment stripped, and the pixels rotated
with EXIF orientation 6 (which a viewer turns back). "keep" is the share of re-encodings whose key
equals the original's key; "held-out" repeats it on the photos' quadrant crops (new framings) and
"synth" on the near-duplicate set's synthetic base pictures (text cards and scenes). Collisions
count unordered pairs of pictures with different pixels and equal keys: among the photos
("coll"), among ~800 distinct images ("coll/N": photos, their quadrant crops, 3x3 and 4x4 tiles,
the 200 LFW thumbnails, three graphics), among colourful photos and their gray and channel-swapped
copies ("colour"), and among the near-duplicate set ("near").

The table ranks candidates (``bench.image_key_candidates``) by the rule: zero collisions in every
collision set, near-duplicates included, first (a collision serves one picture's KV for another:
a wrong answer), then keep. The lines after it measure the two modes of ``hashing.image_keys``
end to end from the encoded bytes, and the last line is one JSON object with those figures.
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np
from PIL import Image
from skimage import data as skdata

from bench.image_key_candidates import Key, candidates
from bench.near_duplicates import images_of, near_duplicate_set
from loraplex.engine.config import EngineConfig
from loraplex.hashing import image_keys as ik

PHOTOS = (
    "astronaut", "brick", "camera", "cat", "coffee", "coins", "grass", "gravel",
    "hubble_deep_field", "immunohistochemistry", "moon", "page", "retina", "rocket", "text",
    "cell", "microaneurysms", "clock", "motorcycle_left", "motorcycle_right",
)  # fmt: skip
QUICK_PHOTOS = ("astronaut", "brick", "camera", "coffee", "coins", "rocket")
GRAPHICS = ("logo", "colorwheel", "horse")

_SETS: dict[str, list[Image.Image]] = {}  # filled before the worker pool forks
_CANDIDATES: dict[str, tuple[Key, str]] = {}  # likewise; workers get only the name


def load(name: str) -> Image.Image:
    if name.startswith("motorcycle_"):
        left, right, _ = skdata.stereo_motorcycle()
        return Image.fromarray(left if name.endswith("left") else right)
    array = getattr(skdata, name)()
    return Image.fromarray(array.astype(np.uint8) * 255 if array.dtype == bool else array)


def encode(image: Image.Image, fmt: str, **params: object) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **params)
    return out.getvalue()


def strip_exif(jpeg: bytes) -> bytes:
    """Drop the APP1 ``Exif`` segments of a JPEG without re-encoding (what exiftool -all= does)."""
    out, pos = bytearray(jpeg[:2]), 2
    while pos < len(jpeg) and jpeg[pos + 1] != 0xDA:  # copy segments up to start-of-scan
        length = int.from_bytes(jpeg[pos + 2 : pos + 4], "big")
        segment = jpeg[pos : pos + 2 + length]
        if not (jpeg[pos + 1] == 0xE1 and segment[4:10] == b"Exif\0\0"):
            out += segment
        pos += 2 + length
    return bytes(out + jpeg[pos:])


def reencodings(image: Image.Image) -> dict[str, bytes]:
    exif = Image.Exif()
    exif[0x010F] = "loraplex bench"  # Make
    exif[0x0131] = "bench.image_keys"  # Software
    rotated = Image.Exif()
    rotated[0x0112] = 6  # Orientation: rotate 90 degrees clockwise to view
    w, h = image.size
    out = {f"jpeg_q{q}": encode(image, "JPEG", quality=q) for q in (60, 70, 80, 90, 95)}
    for pct, flt in ((-10, "LANCZOS"), (-5, "LANCZOS"), (5, "BICUBIC"), (10, "BICUBIC")):
        size = (round(w * (100 + pct) / 100), round(h * (100 + pct) / 100))
        out[f"resize{pct:+d}%"] = encode(image.resize(size, Image.Resampling[flt]), "PNG")
    out["png->jpeg"] = encode(image, "JPEG")
    out["jpeg->png"] = encode(ik.decode_image(encode(image, "JPEG", quality=85)), "PNG")
    out["jpeg_2nd_gen"] = encode(ik.decode_image(encode(image, "JPEG", quality=75)), "JPEG")
    out["webp_q80"] = encode(image, "WEBP", quality=80)
    out["png+exif"] = encode(image, "PNG", exif=exif.tobytes())
    out["jpeg+exif"] = encode(image, "JPEG", quality=95, exif=exif.tobytes())
    out["exif_stripped"] = strip_exif(out["jpeg+exif"])
    rot = image.transpose(Image.Transpose.ROTATE_90)
    out["exif_rotated"] = encode(rot, "PNG", exif=rotated.tobytes())
    return out


def _keys(name: str) -> tuple[str, dict[str, list[str]], float]:
    fn = _CANDIDATES[name][0]
    t0 = time.perf_counter()
    keys = {set_name: [fn(im) for im in images] for set_name, images in _SETS.items()}
    n = sum(len(v) for v in _SETS.values())
    return name, keys, (time.perf_counter() - t0) / n * 1e6


def collisions(keys: list[str]) -> int:
    counts: dict[str, int] = {}
    for key in keys:
        counts[key] = counts.get(key, 0) + 1
    return sum(c * (c - 1) // 2 for c in counts.values())


def keep_rate(keys: list[str], originals: list[str], per: int) -> tuple[float, list[int]]:
    """``keys`` holds ``per`` re-encodings of each original in turn; returns rate and misses."""
    missed = [i for i, key in enumerate(keys) if key != originals[i // per]]
    return 1 - len(missed) / len(keys), missed


def colourfulness(image: Image.Image) -> float:
    """Hasler and Suesstrunk (2003) colourfulness M; 33 and up is "moderately colourful"."""
    a = np.asarray(image, dtype=np.float64)
    rg, yb = a[..., 0] - a[..., 1], 0.5 * (a[..., 0] + a[..., 1]) - a[..., 2]
    return float(np.hypot(rg.std(), yb.std()) + 0.3 * np.hypot(rg.mean(), yb.mean()))


def build(quick: bool) -> dict[str, object]:
    names = QUICK_PHOTOS if quick else PHOTOS
    photos = {n: ik.decode_image(encode(load(n), "PNG")) for n in names}
    variants = {n: reencodings(load(n)) for n in names}
    kinds = list(next(iter(variants.values())))
    crops: dict[str, Image.Image] = {}
    tiles: list[Image.Image] = []
    for n, im in photos.items():
        w, h = im.size
        for k in (2, 3, 4):
            for i, j in itertools.product(range(k), range(k)):
                tile = im.crop((i * w // k, j * h // k, (i + 1) * w // k, (j + 1) * h // k))
                if k == 2 and min(w, h) >= 200:
                    crops[f"{n}#{i}{j}"] = tile
                elif k > 2 and not (quick and k == 4):
                    tiles.append(tile)
    if quick:
        crops = {}
    lfw = [Image.fromarray(np.rint(a * 255).astype(np.uint8)) for a in skdata.lfw_subset()]
    colour = []  # gray and channel-swapped copies of the colourful photos
    for im in photos.values():
        if colourfulness(im) >= 33:
            a = np.asarray(im)
            colour += [im, im.convert("L").convert("RGB"), Image.fromarray(a[..., ::-1].copy())]
    groups = near_duplicate_set(quick)
    near = images_of(groups)
    synth = [im for name, im in near if name.endswith("#0") and not _is_photo_group(name)]
    synth = synth[::3] if quick else synth
    synth_variants = [reencodings(im) for im in synth]
    _SETS["photos"] = list(photos.values())
    _SETS["reenc"] = [ik.decode_image(b) for v in variants.values() for b in v.values()]
    _SETS["crops"] = list(crops.values())
    _SETS["crops_reenc"] = [
        ik.decode_image(b) for c in crops.values() for b in reencodings(c).values()
    ]
    _SETS["others"] = (
        tiles
        + [ik._to_rgb(im) for im in lfw]
        + [ik._to_rgb(load(g)) for g in ([] if quick else GRAPHICS)]
    )
    _SETS["colour"] = colour
    _SETS["near"] = [im for _, im in near]
    _SETS["synth"] = synth
    _SETS["synth_reenc"] = [ik.decode_image(b) for v in synth_variants for b in v.values()]
    return {
        "names": list(names),
        "kinds": kinds,
        "variants": variants,
        "near": near,
        "groups": len(groups),
        "synth_variants": synth_variants,
    }


def _is_photo_group(name: str) -> bool:
    """Whether a near-duplicate picture is one of the photos (their keep rate is measured apart)."""
    return name.split("/")[1] in PHOTO_GROUPS


PHOTO_GROUPS = frozenset(("astronaut", "camera", "coffee", "chelsea", "rocket", "coins", "page"))
KEEP_TARGET = 0.95  # docs/image_keys.md: a perceptual default must keep >= 95% of re-encodings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="6 photos, fewer candidates")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes")
    args = parser.parse_args()
    t_start = time.perf_counter()
    meta = build(args.quick)
    names, kinds, per = meta["names"], meta["kinds"], len(meta["kinds"])
    n_distinct = len(_SETS["photos"]) + len(_SETS["crops"]) + len(_SETS["others"])
    n_near = len(_SETS["near"])
    cands = _CANDIDATES
    cands.update(candidates(args.quick))
    cands["exact-v1"] = (ik.exact_image_key, "256b")
    ctx = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=ctx) as pool:
        results = list(pool.map(_keys, list(cands)))

    print(
        f"{len(names)} photos x {per} re-encodings = {len(_SETS['reenc'])}; held-out: "
        f"{len(_SETS['crops'])} crops x {per} = {len(_SETS['crops_reenc'])}; synthetic: "
        f"{len(_SETS['synth'])} x {per} = {len(_SETS['synth_reenc'])}; distinct images: "
        f"{n_distinct}; colour variants: {len(_SETS['colour'])}; near-duplicates: {n_near} "
        f"pictures in {meta['groups']} groups ({n_near * (n_near - 1) // 2} pairs)\n"
    )
    header = (
        f"{'method':22} {'size':>12} {'keep':>7} {'held-out':>8} {'synth':>7} {'coll':>5} "
        f"{'coll/' + str(n_distinct):>9} {'colour':>6} {'near/' + str(n_near):>8} {'us/key':>8}"
    )
    print(header + "\n" + "-" * len(header))
    rows = {}
    for name, keys, us in results:
        kp, _ = keep_rate(keys["reenc"], keys["photos"], per)
        kq = keep_rate(keys["crops_reenc"], keys["crops"], per)[0] if keys["crops"] else None
        ks, _ = keep_rate(keys["synth_reenc"], keys["synth"], per)
        cp = collisions(keys["photos"])
        cd = collisions(keys["photos"] + keys["crops"] + keys["others"])
        cc = collisions(keys["colour"])
        cn = collisions(keys["near"])
        rows[name] = (kp, kq, ks, cp, cd, cc, cn, keys)
        held = f"{kq:8.1%}" if kq is not None else f"{'-':>8}"
        print(
            f"{name:22} {cands[name][1]:>12} {kp:7.1%} {held} {ks:7.1%} {cp:5d} {cd:9d} "
            f"{cc:6d} {cn:8d} {us:8.0f}"
        )

    def meets_both(name: str) -> bool:
        kp, kq, ks, cp, cd, cc, cn, _ = rows[name]
        keeps = [k for k in (kp, kq, ks) if k is not None]
        return cp == cd == cc == cn == 0 and min(keeps) >= KEEP_TARGET

    both = [n for n in rows if meets_both(n) and n != "exact-v1"]
    fewest = min((n for n in rows if n != "exact-v1"), key=lambda n: (rows[n][6], -rows[n][0]))
    print(
        f"\nperceptual candidates meeting both (0 near-duplicate collisions, keep >= "
        f"{KEEP_TARGET:.0%} everywhere): {', '.join(both) or 'none'}; fewest near-duplicate "
        f"collisions: {fewest} ({rows[fewest][6]} pairs, keeps {rows[fewest][0]:.1%} of photo "
        f"re-encodings)"
    )
    if args.quick:
        print("(quick run: fewer pictures and candidates; the full run decides)")
    used = f"pdct f<={ik._MAX_FREQ}"
    missed = keep_rate(rows[used][7]["reenc"], rows[used][7]["photos"], per)[1]
    print(f"{used} misses: {[f'{names[i // per]}:{kinds[i % per]}' for i in missed]}")
    near_keys = rows[used][7]["near"]
    merged = _merged_groups(meta["near"], near_keys)
    print(f"{used} merges near-duplicates in {len(merged)} groups, e.g. {merged[:4]}")

    figures = {mode: _end_to_end(mode, meta) for mode in ("perceptual", "exact")}
    for mode, f in figures.items():
        print(
            f"{mode:10} keep {f['keep']:6.1%} photos, {f['keep_synth']:6.1%} synthetic; "
            f"near-duplicates: {f['near']} colliding pairs among {n_near} pictures; photo "
            f"collisions {f['coll']}; {f['us_key']:6.0f} us/key decoded, "
            f"{f['us_bytes']:6.0f} us/key from bytes; "
            f"always kept: {', '.join(f['always']) or 'none'}"
        )
    exact = figures["exact"]["keys"]
    same = sum(
        exact[i * per + kinds.index("jpeg+exif")] == exact[i * per + kinds.index("exif_stripped")]
        for i in range(len(names))
    )
    print(f"exact: JPEG with EXIF == same JPEG stripped of it for {same}/{len(names)} photos")
    default = EngineConfig(model="").mm_hash
    p, e = figures["perceptual"], figures["exact"]
    p_both = p["near"] == 0 and min(p["keep"], p["keep_synth"]) >= KEEP_TARGET
    print(
        f"default mode (EngineConfig.mm_hash): {default}; perceptual meets both: {p_both}"
        + ("" if p_both or default == "exact" else "  NOTE: the default should be exact")
    )
    result = {
        "default_mode": default,
        "perceptual_meets_both": p_both,
        "perceptual_candidates_meeting_both": both,
        "near_duplicate_images": n_near,
        "near_duplicate_groups": meta["groups"],
        "perceptual_near_duplicate_collisions": p["near"],
        "exact_near_duplicate_collisions": e["near"],
        "perceptual_keep_rate": round(p["keep"], 4),
        "exact_keep_rate": round(e["keep"], 4),
        "perceptual_keep_rate_synthetic": round(p["keep_synth"], 4),
        "exact_keep_rate_synthetic": round(e["keep_synth"], 4),
        "perceptual_collisions": p["coll"],
        "exact_collisions": e["coll"],
        "photos": len(names),
        "reencodings": len(_SETS["reenc"]),
        "reencodings_synthetic": len(_SETS["synth_reenc"]),
        "method": ik.PERCEPTUAL_METHOD,
        "perceptual_keep_rate_heldout": None if rows[used][1] is None else round(rows[used][1], 4),
        "distinct_images": n_distinct,
        "perceptual_collisions_distinct": rows[used][4],
        "perceptual_us_per_key": round(p["us_key"]),
        "exact_us_per_key": round(e["us_key"]),
        "quick": args.quick,
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    print(json.dumps(result))


def _merged_groups(near: list[tuple[str, Image.Image]], keys: list[str]) -> list[str]:
    """Names of the near-duplicate groups two of whose pictures got one key."""
    by_key: dict[str, list[str]] = {}
    for (name, _), key in zip(near, keys, strict=True):
        by_key.setdefault(key, []).append(name.split("#")[0])
    merged = {g for names in by_key.values() if len(names) > 1 for g in names}
    return sorted(merged)


def _end_to_end(mode: str, meta: dict) -> dict:
    """One mode of ``image_key`` measured from the encoded bytes (decode included)."""
    names, per = meta["names"], len(meta["kinds"])
    t0 = time.perf_counter()
    originals = [ik.image_key(encode(load(n), "PNG"), mode) for n in names]
    keys = [ik.image_key(b, mode) for n in names for b in meta["variants"][n].values()]
    us_bytes = (time.perf_counter() - t0) / (len(originals) + len(keys)) * 1e6
    synth = [ik.image_key(encode(im, "PNG"), mode) for im in _SETS["synth"]]
    synth_keys = [ik.image_key(b, mode) for v in meta["synth_variants"] for b in v.values()]
    near = [ik.image_key(encode(im, "PNG"), mode) for _, im in meta["near"]]
    fn = ik.perceptual_image_key if mode == "perceptual" else ik.exact_image_key
    t0 = time.perf_counter()
    for im in _SETS["photos"] * 3:
        fn(im)
    us_key = (time.perf_counter() - t0) / (3 * len(_SETS["photos"])) * 1e6
    rate, miss = keep_rate(keys, originals, per)
    return {
        "keep": rate,
        "keep_synth": keep_rate(synth_keys, synth, per)[0],
        "near": collisions(near),
        "coll": collisions(originals),
        "us_key": us_key,
        "us_bytes": us_bytes,
        "keys": keys,
        "always": [k for j, k in enumerate(meta["kinds"]) if all(i % per != j for i in miss)],
    }


if __name__ == "__main__":
    main()
