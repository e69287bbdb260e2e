"""What two engines must agree on before one READs the other's KV pages.

A READ copies raw page bytes: if the peers differ in model, cache dtype, block size or page
layout, the bytes land without error and decode reads them as something else, silently
wrong. So each worker describes its cache in a `KVCompat` record that travels with its NIXL
metadata (`PeerInfo.compat`), and `add_peer` refuses a peer whose record differs, with every
difference named, at start-up, before any request (docs/design.md §12).

Tensor parallelism. Every rank's agent carries its engine's record, and every rank checks
every remote rank's. A rank's page holds its share of the heads, so between engines of
different TP sizes the page sizes differ by design (a rank reads head slices, kv/nixl/tp_slices.py):
they are compared only between equal TP sizes; everything else must still match.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from dataclasses import dataclass, fields
from pathlib import Path

from kv.cache_layout import CacheLayout

# A rank's share of the heads: these differ between engines of different TP sizes.
_PER_RANK = ("page_bytes", "attn_page_bytes", "mamba_page_bytes")


class KVCompatError(ValueError):
    """A peer's KV cannot be read by this engine."""


@dataclass(frozen=True, slots=True)
class KVCompat:
    model_digest: str  # sha256 of the canonical config.json: the same architecture and sizes
    cache_dtype: str
    block_size: int
    page_bytes: int
    attn_page_bytes: int
    mamba_page_bytes: int
    groups: tuple[str, ...]  # "kind:layer,layer,..." per cache group, in order
    num_buffers: int
    version: str  # raypd's: the page layout is this code's, not a standard
    kv_checksum: str  # kv/nixl/verify.py's algorithm, "" without --kv-verify: both sides must agree
    model_name: str = ""  # for the message only: one model may sit at different paths
    tp_size: int = 1  # the engine's tensor-parallel ranks: unequal sizes are allowed

    def check(self, peer: KVCompat, peer_name: str) -> None:
        """Raise KVCompatError naming every field on which `peer` differs from this engine."""
        diffs = [
            f"{f.name} {getattr(peer, f.name)!r} (peer) vs {getattr(self, f.name)!r} (here)"
            for f in fields(self)
            if f.name not in ("model_name", "tp_size")
            and not (f.name in _PER_RANK and peer.tp_size != self.tp_size)
            and getattr(peer, f.name) != getattr(self, f.name)
        ]
        if diffs:
            raise KVCompatError(
                f"peer {peer_name} (model {peer.model_name!r}) cannot share KV with this engine "
                f"(model {self.model_name!r}): " + "; ".join(diffs)
            )


def kv_compat(model_dir: str, layout: CacheLayout, kv_checksum: str = "", tp_size: int = 1) -> KVCompat:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]
    return KVCompat(
        model_digest=digest,
        cache_dtype=layout.attn_dtype,
        block_size=layout.block_size,
        page_bytes=layout.page_bytes,
        attn_page_bytes=layout.attn_page_bytes,
        mamba_page_bytes=layout.mamba_page_bytes,
        groups=tuple(f"{g.kind}:{','.join(map(str, g.layer_ids))}" for g in layout.groups),
        num_buffers=len(layout.buffers),
        version=_version(),
        kv_checksum=kv_checksum,
        model_name=Path(model_dir).name,
        tp_size=tp_size,
    )


def _version() -> str:
    try:
        return importlib.metadata.version("raypd")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"
