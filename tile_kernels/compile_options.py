"""TileLang compile options shared by the kernel definitions.

Every kernel here clamps or masks each global read itself (any index value is safe by
construction), so TileLang's automatic per-access bounds guards are redundant. They are also
harmful: a guard per element splits 16-byte vector loads into byte loads and keeps copies
from being vectorised. Builders attach this to their prim_func with
``func.with_attr("tilelang_pass_configs", NO_AUTO_BOUNDS_GUARDS)``; ``tilelang.compile``
reads it from there, so artifacts built by any route use the same options.
"""

NO_AUTO_BOUNDS_GUARDS = {"tl.disable_safe_memory_legalize": True}
