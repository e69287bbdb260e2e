"""What every long-lived raypd process does once it has started."""

from __future__ import annotations

import gc


def freeze_startup_objects() -> None:
    """Move what start-up made (Ray, torch, the model: ~200k objects in a worker) out of the
    collector's reach. Those objects live as long as the process, yet every full collection
    walked them: 108 ms each time in a worker, a stall inside a step; 0.0 ms once frozen."""
    gc.freeze()
