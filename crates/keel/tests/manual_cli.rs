//! `keel completions SHELL` and `keel man`: run the real binary, then the real bash and man.

use std::process::Command;

const KEEL: &str = env!("CARGO_BIN_EXE_keel");

fn keel(args: &[&str]) -> String {
    let out = Command::new(KEEL).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "keel {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The subcommands `keel --help` lists (clap's own `help` left out).
fn subcommands() -> Vec<String> {
    let help = keel(&["--help"]);
    let list = help
        .split("Commands:\n")
        .nth(1)
        .expect("a Commands section");
    let names: Vec<String> = list
        .lines()
        .take_while(|l| !l.trim().is_empty())
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| *n != "help")
        .map(String::from)
        .collect();
    for expected in ["lab", "proxy", "backend", "completions", "man"] {
        assert!(names.iter().any(|n| n == expected), "{names:?}");
    }
    names
}

/// What bash completes after `line` (words split on spaces) with keel's script loaded.
fn bash_complete(script: &std::path::Path, words: &[&str]) -> Vec<String> {
    let words_sh: Vec<String> = words.iter().map(|w| format!("'{w}'")).collect();
    let cword = words.len() - 1;
    let prev = if cword > 0 { words[cword - 1] } else { "" };
    let program = format!(
        "source '{}'; COMP_WORDS=({}); COMP_CWORD={cword}; _keel keel '{}' '{prev}'; \
         printf '%s\\n' \"${{COMPREPLY[@]}}\"",
        script.display(),
        words_sh.join(" "),
        words[cword]
    );
    let out = Command::new("bash")
        .args(["-c", &program])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(String::from)
        .collect()
}

#[test]
fn bash_completes_every_subcommand_and_the_proxy_flags() {
    let script = keel(&["completions", "bash"]);
    let names = subcommands();
    for n in &names {
        assert!(script.contains(n.as_str()), "{n} missing from the script");
    }
    let path = std::env::temp_dir().join(format!("keel-completions-{}.bash", std::process::id()));
    std::fs::write(&path, &script).unwrap();
    // Completing an empty word offers every subcommand; a prefix narrows it to one.
    let all = bash_complete(&path, &["keel", ""]);
    for n in &names {
        assert!(all.contains(n), "{n} not offered: {all:?}");
    }
    assert_eq!(bash_complete(&path, &["keel", "pro"]), ["proxy"]);
    assert_eq!(
        bash_complete(&path, &["keel", "proxy", "--log-f"]),
        ["--log-format"]
    );
    let _ = std::fs::remove_file(&path);

    for shell in ["zsh", "fish", "elvish", "powershell"] {
        let s = keel(&["completions", shell]);
        assert!(s.contains("proxy") && s.contains("--log-format"), "{shell}");
    }
    let out = Command::new(KEEL)
        .args(["completions", "tcsh"])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(2),
        "an unknown shell is a usage error"
    );
}

/// Renders a roff page with `man -l` (warnings on) when man is installed; its text.
fn render(page: &std::path::Path) -> Option<String> {
    let out = Command::new("man")
        .args(["--warnings", "-l", "-P", "cat"])
        .arg(page)
        .env("MANWIDTH", "100")
        .output()
        .ok()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "man -l {}: {stderr}", page.display());
    assert!(stderr.trim().is_empty(), "roff warnings: {stderr}");
    Some(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[test]
fn the_man_pages_render_and_name_every_subcommand() {
    let names = subcommands();
    let dir = std::env::temp_dir().join(format!("keel-man-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let main = keel(&["man"]);
    assert!(main.contains(".TH keel 1"), "{main}");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("printed.1"), &main).unwrap();
    let text = render(&dir.join("printed.1")).unwrap_or_else(|| {
        eprintln!("man is not installed: checking the roff source only");
        main.replace("\\-", "-")
    });
    for n in &names {
        assert!(
            text.contains(&format!("keel-{n}(1)")),
            "{n} missing:\n{text}"
        );
    }

    // --out writes one page per subcommand; keel-proxy(1) documents its flags.
    keel(&["man", "--out", dir.join("man1").to_str().unwrap()]);
    for n in names
        .iter()
        .map(|n| format!("keel-{n}"))
        .chain(["keel".into()])
    {
        let page = dir.join("man1").join(format!("{n}.1"));
        let roff = std::fs::read_to_string(&page).unwrap_or_else(|e| panic!("{n}.1: {e}"));
        assert!(roff.contains(&format!(".TH {n} 1")), "{n}: {roff}");
        render(&page);
    }
    let proxy = keel(&["man", "proxy"]);
    assert_eq!(
        proxy,
        std::fs::read_to_string(dir.join("man1/keel-proxy.1")).unwrap()
    );
    let proxy = render(&dir.join("man1/keel-proxy.1")).unwrap_or(proxy.replace("\\-", "-"));
    for flag in ["--config", "--log-format", "--pid-file"] {
        assert!(proxy.contains(flag), "{flag}:\n{proxy}");
    }
    let out = Command::new(KEEL).args(["man", "nosuch"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let _ = std::fs::remove_dir_all(&dir);
}
