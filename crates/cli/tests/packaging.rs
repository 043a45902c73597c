//! The files a package installs beside the binary: systemd units checked
//! by `systemd-analyze verify` (instantiated, pointing at the binary under
//! test, any warning is a failure).

use std::path::{Path, PathBuf};
use std::process::Command;

fn units_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../packaging/systemd")
}

fn have(tool: &str) -> bool {
    Command::new(tool).arg("--version").output().is_ok()
}

#[test]
fn systemd_units_verify() {
    assert!(
        have("systemd-analyze"),
        "systemd-analyze is missing (scripts/test.sh installs systemd)"
    );
    let dir = tempfile::tempdir().unwrap();
    let mut units = Vec::new();
    for e in std::fs::read_dir(units_dir()).unwrap() {
        let path = e.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap().to_string();
        assert!(name.contains("@."), "{name}: expected a template unit");
        let text = std::fs::read_to_string(&path).unwrap();
        let text = text.replace("/usr/bin/onecopy", env!("CARGO_BIN_EXE_onecopy"));
        let inst = dir.path().join(name.replace("@.", "@srv-data."));
        std::fs::write(&inst, text).unwrap();
        units.push(inst);
    }
    assert_eq!(units.len(), 4, "{units:?}");
    let out = Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .args(&units)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stderr.trim().is_empty(),
        "systemd-analyze verify: {}\n{stderr}",
        out.status
    );
}

#[test]
fn dedupe_unit_runs_idle_on_the_escaped_path() {
    let unit = std::fs::read_to_string(units_dir().join("onecopy-dedupe@.service")).unwrap();
    for line in [
        "ExecStart=/usr/bin/onecopy dedupe --quiet %f",
        "IOSchedulingClass=idle",
        "Nice=19",
        "CPUWeight=10",
    ] {
        assert!(unit.lines().any(|l| l == line), "missing {line:?}");
    }
}

/// bench/charts.py turns a results file into SVG charts with one bar per
/// tool that ran, and names the tools that did not.
#[test]
fn bench_charts_render() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = tempfile::tempdir().unwrap();
    let st = Command::new("python3")
        .arg(repo.join("bench/charts.py"))
        .arg(repo.join("bench/testdata/sample-result.json"))
        .arg("--out")
        .arg(out.path())
        .status()
        .expect("python3");
    assert!(st.success());
    let wall = std::fs::read_to_string(out.path().join("wall.svg")).unwrap();
    assert!(wall.starts_with("<svg") && wall.trim_end().ends_with("</svg>"));
    for t in ["onecopy: 3.1 s", "duperemove: 9.5 s", "find-stat: 0.2 s"] {
        assert!(wall.contains(t), "no bar {t:?}");
    }
    assert!(
        wall.contains("not shown: fclones"),
        "missing tool not named"
    );
    let freed = std::fs::read_to_string(out.path().join("freed.svg")).unwrap();
    assert!(freed.contains("onecopy: 512 MiB"), "{freed}");
    let rerun = std::fs::read_to_string(out.path().join("rerun.svg")).unwrap();
    assert!(rerun.contains("onecopy: 0.3 s"));
}
