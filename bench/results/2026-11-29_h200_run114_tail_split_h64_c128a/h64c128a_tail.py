"""h35_tail_ab.py on h64 C128A 1024 rows (bucket h64_c128a_ctas67_up, not routed: run 107
measured no h64 C128A row). Same columns: shipped vs tail (forced) vs FlashMLA."""
import sys
sys.path.insert(0, "scripts/lab")
import h35_tail_ab as ab  # noqa: E402


def rows():
    from dsv4_tl.bench import DecodeShape
    out = [DecodeShape(64, b, "c128a", extra_width=1024) for b in (140, 150, 200, 264)]
    out += [DecodeShape(64, 74, "c128a", s_q=2, extra_width=1024),
            DecodeShape(64, 32, "c128a", s_q=6, extra_width=1024)]
    return out


ab.rows = rows
ab.main()
