"""``dsv4-tl bench --shape``: the parser (every field, its defaults, one-line errors naming
the bad field) and the inputs a parsed shape builds (the SWA width reaches the index rows)."""

import pytest
import torch

from dsv4_tl import bench
from dsv4_tl.bench import DecodeShape, PrefillShape, parse_shape


@pytest.mark.parametrize("text, shape", [
    ("decode:h=64,b=64,extra=c4a:512", DecodeShape(64, 64, "c4a", extra_width=512)),
    ("decode:h=128,b=8,s_q=2,swa=256,extra=c128a:8192,lens=rand",
     DecodeShape(128, 8, "c128a", s_q=2, extra_width=8192, varying=True, window=256)),
    (" decode : b=1 , h=16 ", DecodeShape(16, 1, "swa")),
    ("decode:h=64,b=4,extra=none,lens=full", DecodeShape(64, 4, "swa")),
    ("prefill:h=64,s_q=4096,topk=640,s_kv=32768", PrefillShape(64, 4096, 640, 32768)),
    ("prefill:h=16,s_q=8,topk=128,s_kv=520,lens=rand,form=ragged",
     PrefillShape(16, 8, 128, 520, varying=True, ragged=True)),
])
def test_parse_shape(text, shape):
    assert parse_shape(text) == shape


@pytest.mark.parametrize("text, message", [
    ("decod:h=64,b=1", "must start with 'decode:' or 'prefill:'"),
    ("h=64,b=1", "must start with 'decode:' or 'prefill:'"),
    ("decode:h=64", "decode needs field 'b'"),
    ("prefill:h=64,s_q=8,topk=640", "prefill needs field 's_kv'"),
    ("decode:h=64,b=1,topk=3", "unknown decode field 'topk' (known: h, b, s_q, swa, extra, lens)"),
    ("decode:h=64,b=1,h=8", "field 'h' is given twice"),
    ("decode:h=64,,b=1", "'' is not field=value"),
    ("decode:h=64,b", "'b' is not field=value"),
    ("decode:h=64,b=", "'b=' is not field=value"),
    ("decode:h=sixty,b=1", "field 'h': expected an integer, got 'sixty'"),
    ("decode:h=64,b=0", "field 'b': 0 is below 1"),
    ("decode:h=64,b=1,s_q=65", "field 's_q': 65 is outside 1..64"),
    ("decode:h=64,b=1,swa=0", "field 'swa': 0 is below 1"),
    ("decode:h=64,b=1,extra=c4a", "field 'extra': expected c4a:W with W a positive integer"),
    ("decode:h=64,b=1,extra=c4a:0", "field 'extra': width 0 is below 1"),
    ("decode:h=64,b=1,extra=c64a:8", "field 'extra': expected none, c4a:W or c128a:W"),
    ("decode:h=64,b=1,lens=rand", "field 'lens': rand needs a compressed scope"),
    ("decode:h=64,b=1,lens=some", "field 'lens': expected full or rand, got 'some'"),
    ("prefill:h=64,s_q=10,topk=640,s_kv=32768", "field 's_q': 10 is not a multiple of 4"),
    ("prefill:h=64,s_q=8,topk=100,s_kv=32768", "field 'topk': 100 is below 128"),
    ("prefill:h=64,s_q=8,topk=640,s_kv=2567", "field 's_kv': 2567 is too small"),
    ("prefill:h=64,s_q=8,topk=640,s_kv=4096,form=csr", "field 'form': expected dense or ragged"),
    # issue 34 item 7: sizes are bounded (h by 1024, every input tensor by int32 indexing)
    ("decode:h=1025,b=1", "field 'h': 1025 is outside 1..1024"),
    ("decode:h=100000000000000000000,b=1", "field 'h': 100000000000000000000 is outside 1..1024"),
    ("decode:h=64,b=100000", "fields h, b, s_q: the query [b, s_q, h, 512] would hold "
                             "3276800000 elements, over 2147483647 (the kernels index in int32)"),
    ("decode:h=8,b=1,swa=10000000000", "fields b, swa: the SWA cache"),
    ("decode:h=8,b=64,extra=c128a:100000000", "fields b, extra: the compressed cache"),
    ("prefill:h=2048,s_q=8,topk=640,s_kv=32768", "field 'h': 2048 is outside 1..1024"),
    ("prefill:h=64,s_q=8,topk=640,s_kv=100000000000", "field s_kv: the workspace [s_kv, 512]"),
    ("prefill:h=1,s_q=8192,topk=128,s_kv=4000000", "fields s_q, s_kv: the top-k draw"),
])
def test_parse_shape_errors_name_the_field(text, message):
    with pytest.raises(ValueError) as exc:
        parse_shape(text)
    assert message in str(exc.value) and "\n" not in str(exc.value)
    assert str(exc.value).startswith(f"--shape {text!r}: ")


def test_bench_cli_shape_error_is_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--shape", "decode:h=64,b=64,extra=c4a:512", "--shape", "decode:h=64,b=x"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "dsv4-tl bench: error: --shape 'decode:h=64,b=x': field 'b': expected an integer" in err


def test_bench_cli_shape_does_not_go_with_a_suite(capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--shape", "decode:h=64,b=1", "--suite", "gather"])
    assert exc.value.code == 2
    assert "--shape replaces the suites; drop --suite gather" in capsys.readouterr().err


def test_shape_help_shows_the_syntax(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    out = capsys.readouterr().out
    assert "decode:h=H,b=B[,s_q=1][,swa=128][,extra=none|c4a:W|c128a:W][,lens=full|rand]" in out
    assert "prefill:h=H,s_q=S,topk=K,s_kv=N[,lens=full|rand][,form=dense|ragged]" in out


def test_parsed_decode_shape_builds_its_window_and_scope(seed):
    shape = parse_shape("decode:h=8,b=3,s_q=2,swa=200,extra=c128a:96,lens=rand")
    gen = torch.Generator().manual_seed(seed)
    (x,) = bench.decode_inputs(shape, gen, 1, "cpu")
    assert x["q"].shape == (3, 2, 8, 512)
    assert x["indices"].shape == (3, 2, 200) and x["topk_length"].tolist() == [200] * 3
    assert x["extra_indices"].shape == (3, 2, 96) and x["extra_k_cache"].shape[1] == 2
    assert int(x["extra_topk_length"].max()) <= 96
    # the window: consecutive positions, distinct slots, inside the SWA cache
    slots = x["indices"].reshape(-1, 200)
    assert all(len(set(row.tolist())) == 200 for row in slots)
    assert int(slots.max()) < x["k_cache"].shape[0] * x["k_cache"].shape[1]
    assert shape.name == "decode h8 b3 s_q 2 window 200 + C128A 96 (bs 2), lengths 0..width"


def test_format_ratios_names_each_peer():
    report = {"rows": [{"shape": "decode h64 b64", "results": [
        {"impl": "dsv4_tl", "us": 40.0}, {"impl": "flashmla", "us": 46.0},
        {"impl": "tri_xpu", "error": "not loaded: x"}]},
        {"shape": "prefill", "results": [{"impl": "dsv4_tl", "error": "E"},
                                          {"impl": "flashmla", "us": 3.0}]}]}
    lines = bench.format_ratios(report).splitlines()
    assert lines[1] == ("  decode h64 b64: flashmla 1.15x (46.0 vs 40.0 us); "
                        "tri_xpu n/a (peer failed)")
    assert lines[2] == "  prefill: flashmla n/a (dsv4_tl failed)"
