"""bench-eagle runs end to end on a tiny random architecture and writes what serve-eagle reads."""

import json

from eyas.serve.bench import main


def test_bench_tiny_random(tmp_path, capsys):
    main(["--random-weights", "--arch", "tiny", "--input-len", "32", "--output-len", "12", "--batch-sizes", "1", "2",
          "--trees", "3,1,4", "2,2,4", "--device", "cpu", "--autotune", str(tmp_path / "autotune.json"),
          "--json", str(tmp_path / "results.json")])
    table = capsys.readouterr().out
    assert "speedup" in table and table.count("\n") == 7  # header + 2 batch sizes x 3 settings
    results = json.loads((tmp_path / "results.json").read_text())
    assert {(r["batch_size"], r["setting"]) for r in results} == {
        (b, s) for b in (1, 2) for s in ("off", "3,1,4", "2,2,4")}
    for r in results:
        assert r["tokens_per_s"] > 0 and r["step_ms"] > 0
        if r["setting"] == "off":
            assert r["speedup"] == 1.0 and r["draft_ms"] < r["verify_ms"]
    best = json.loads((tmp_path / "autotune.json").read_text())["best_setting_by_batch_size"]
    assert set(best) == {"1", "2"} and all(v in ("off", "3,1,4", "2,2,4") for v in best.values())
