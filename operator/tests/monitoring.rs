//! The dashboards and alerting rules: the checked-in files under `charts/ferry/monitoring/` are
//! what the code generates, and `dashboards/` at the root is that same folder. (Their queries are
//! evaluated against a real Prometheus by `tests/monitoring`, their rules by `promtool`.)

use std::path::{Path, PathBuf};

use ferry_operator::monitoring::{files, DIR};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

#[test]
fn the_checked_in_dashboards_and_rules_are_what_the_code_generates() {
    let generated = files();
    for (name, text) in &generated {
        let path = repo().join(DIR).join(name);
        let checked_in = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            checked_in == *text,
            "{} is out of date: run `cargo run -p ferry-operator -- monitoring`",
            path.display()
        );
    }
    let mut on_disk: Vec<String> = std::fs::read_dir(repo().join(DIR))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    on_disk.sort();
    let mut names: Vec<String> = generated.iter().map(|(n, _)| (*n).to_owned()).collect();
    names.sort();
    assert_eq!(on_disk, names, "{DIR} holds exactly the generated files");
}

#[test]
fn the_dashboards_folder_at_the_root_is_the_charts() {
    let link = std::fs::read_link(repo().join("dashboards")).expect("dashboards is a symbolic link");
    assert_eq!(repo().join(&link).canonicalize().unwrap(), repo().join(DIR).canonicalize().unwrap());
}
