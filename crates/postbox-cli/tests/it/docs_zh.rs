//! The Chinese docs (`docs/zh-CN/`) stay in step with the product: every
//! `postbox` command they show exists (its `--help` runs), and every TOML
//! block is a configuration postbox accepts.

use std::path::{Path, PathBuf};
use std::process::Command;

fn docs() -> Vec<(PathBuf, String)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/zh-CN");
    let mut docs: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .map(|p| {
            let text = std::fs::read_to_string(&p).unwrap();
            (p, text)
        })
        .collect();
    docs.sort();
    assert!(docs.len() >= 2, "README.md and room-service.md");
    docs
}

/// The fenced blocks of `lang` in `text`.
fn blocks(text: &str, lang: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut current: Option<String> = None;
    for line in text.lines() {
        match (&mut current, line.strip_prefix("```")) {
            (None, Some(tag)) if tag.trim() == lang => current = Some(String::new()),
            (Some(_), Some(_)) => out.push(current.take().unwrap()),
            (Some(block), None) => {
                block.push_str(line);
                block.push('\n');
            }
            _ => {}
        }
    }
    out
}

/// The subcommand words of a `postbox …` line: after the global options,
/// up to the first option or argument.
fn subcommand(line: &str) -> Option<Vec<String>> {
    let line = line
        .split('#')
        .next()
        .unwrap()
        .trim()
        .trim_end_matches('&')
        .trim();
    let mut words = line.split_whitespace();
    if words.next()? != "postbox" {
        return None;
    }
    let mut sub = Vec::new();
    let mut words = words.peekable();
    while let Some(w) = words.next() {
        if w == "--config" || w == "--database-url" {
            words.next();
            continue;
        }
        if w.starts_with('-') || !w.chars().all(|c| c.is_ascii_lowercase() || c == '-') {
            break;
        }
        sub.push(w.to_owned());
        // `events list`, `events show`: one more word names the command.
        if w != "events" {
            break;
        }
    }
    Some(sub)
}

#[test]
fn every_postbox_command_in_the_chinese_docs_exists() {
    let mut checked = 0;
    for (path, text) in docs() {
        for line in blocks(&text, "sh").iter().flat_map(|b| b.lines()) {
            let Some(sub) = subcommand(line) else {
                continue;
            };
            assert!(
                !sub.is_empty(),
                "{}: `{line}` names no command",
                path.display()
            );
            let out = Command::new(env!("CARGO_BIN_EXE_postbox"))
                .args(&sub)
                .arg("--help")
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{}: `{line}`: `postbox {} --help` failed: {}",
                path.display(),
                sub.join(" "),
                String::from_utf8_lossy(&out.stderr)
            );
            checked += 1;
        }
    }
    assert!(checked >= 15, "only {checked} commands found");
}

#[test]
fn every_config_in_the_chinese_docs_parses() {
    let dir = tempfile::tempdir().unwrap();
    let mut checked = 0;
    for (path, text) in docs() {
        for (i, block) in blocks(&text, "toml").into_iter().enumerate() {
            let file = dir.path().join(format!("block{i}.toml"));
            std::fs::write(&file, &block).unwrap();
            postbox_core::config::load(&postbox_core::config::ConfigSource {
                file: Some(file),
                database_url: None,
            })
            .unwrap_or_else(|e| panic!("{}: TOML block {}: {e}\n{block}", path.display(), i + 1));
            checked += 1;
        }
    }
    assert!(checked >= 2, "only {checked} TOML blocks found");
}
