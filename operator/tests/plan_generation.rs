//! The README's `ferry-operator plan-generation` example is what the binary prints for the
//! command it shows.

use std::process::Command;

#[test]
fn the_readmes_generation_plan_is_what_the_binary_prints() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md")).unwrap();
    let start = readme.find("$ ferry-operator plan-generation ").expect("the README shows the command");
    let block = &readme[start..];
    let block = &block[..block.find("```").expect("the block ends")];
    let mut lines = block.lines();
    let command = lines.next().expect("the command").trim_start_matches("$ ferry-operator ");
    let shown: String = lines.map(|l| format!("{l}\n")).collect();
    let out = Command::new(env!("CARGO_BIN_EXE_ferry-operator")).args(command.split_whitespace()).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(
        String::from_utf8(out.stdout).unwrap(),
        shown,
        "the README's plan-generation output is stale: run `ferry-operator {command}` and paste it"
    );
}
