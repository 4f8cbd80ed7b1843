//! The command line is parsing and printing: the compiler and the runtime are reached only
//! through `autopar-driver`, which a program embedding autopar uses the same way.

use std::path::Path;

/// Ways `src/` could reach past the driver into the passes or the runtime.
const FORBIDDEN: [&str; 6] = [
    "autopar_passes",
    "autopar_runtime",
    "driver::passes",
    "driver::runtime",
    "autopar_driver::passes",
    "autopar_driver::runtime",
];

#[test]
fn the_cli_reaches_the_compiler_only_through_the_driver() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut checked = 0;
    // Modules in subdirectories (`src/report/`) are held to the same rule.
    let mut files = Vec::new();
    let mut dirs = vec![src.clone()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("src/ is readable") {
            let path = entry.expect("an entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else {
                files.push(path);
            }
        }
    }
    for path in files {
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("a source file");
        for (i, line) in text.lines().enumerate() {
            for f in FORBIDDEN {
                assert!(
                    !line.contains(f),
                    "{}:{}: `{f}`: the CLI must go through autopar-driver's own API",
                    path.display(),
                    i + 1
                );
            }
        }
        checked += 1;
    }
    assert!(checked >= 4, "only {checked} files under {}", src.display());
    // The manifest says the same: the binary depends on the driver and the cost model only.
    let manifest =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml"))
            .expect("Cargo.toml");
    let deps = manifest
        .split("[dependencies]")
        .nth(1)
        .and_then(|s| s.split("\n[").next())
        .expect("a [dependencies] table");
    for crate_name in [
        "autopar-passes",
        "autopar-runtime",
        "autopar-ir",
        "autopar-frontends",
    ] {
        assert!(
            !deps.contains(crate_name),
            "the binary depends on {crate_name} directly"
        );
    }
}
