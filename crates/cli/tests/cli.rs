//! End-to-end tests of the `slipstream` binary: repack a committed fixture,
//! run it from token ids and from text, dump logits, run the demo model,
//! and fail cleanly on bad input.

mod common;

use std::path::Path;

use common::{read_json, repack_fixture, run, run_command, slipstream, utf8};
use slipstream_engine::npy;
use slipstream_testkit::cli::{failed, ok, reference_ids};
use slipstream_testkit::{bin, fixture};

/// Token ids as `--prompt-tokens` takes them: `1,2,3`.
fn id_list(ids: &[u32]) -> String {
    let ids: Vec<String> = ids.iter().map(|t| t.to_string()).collect();
    ids.join(",")
}

#[test]
fn prompt_tokens_and_dump_logits_match_the_reference() {
    let tmp = tempfile::tempdir().unwrap();
    let name = "qwen3_5_moe_fused";
    let model = repack_fixture(name, "f32", tmp.path());
    let prompt = reference_ids(name, "prompt_tokens");
    let greedy = reference_ids(name, "greedy_tokens");
    let dump = tmp.path().join("logits.npy");
    let stats = tmp.path().join("stats.json");
    let (stdout, stderr) = ok(run(
        &model,
        &[
            "--prompt-tokens",
            &id_list(&prompt),
            "--max-new",
            "8",
            "--print-ids",
            "--dump-logits",
            utf8(&dump),
            "--stats-json",
            utf8(&stats),
        ],
    ));
    let got: Vec<u32> = stdout
        .split_whitespace()
        .map(|s| s.parse().unwrap())
        .collect();
    assert_eq!(got, greedy);
    for field in ["time to first token", "prefill", "decode", "peak RSS"] {
        assert!(stderr.contains(field), "stats line lacks {field}: {stderr}");
    }
    let (shape, ours) = npy::read_f32(&dump).unwrap();
    let (rshape, reference) = npy::read_f32(&fixture(name).join("logits.npy")).unwrap();
    assert_eq!(shape, vec![prompt.len() + greedy.len() - 1, rshape[1]]);
    // The reference also holds the row after the last generated token,
    // which a run never computes: the rows before it are compared.
    assert_eq!(rshape[0], shape[0] + 1, "reference rows");
    let reference = &reference[..ours.len()];
    let max_ref = reference.iter().fold(0f32, |m, v| m.max(v.abs()));
    let max_diff = ours
        .iter()
        .zip(reference)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(
        max_diff / max_ref < 1e-4,
        "dumped logits differ: {}",
        max_diff / max_ref
    );
    assert_eq!(read_json(&stats)["stats"]["prompt_tokens"], prompt.len());
}

#[test]
fn text_prompt_and_chat_template_run() {
    let tmp = tempfile::tempdir().unwrap();
    let model = repack_fixture("qwen3_moe", "q4", tmp.path());
    let (stdout, _) = ok(run(
        &model,
        &["--prompt", "We hold these truths", "--max-new", "6"],
    ));
    assert!(stdout.starts_with("We hold these truths"), "{stdout}");
    let sampled = || {
        let mut cmd = run_command(&model, &["--chat", "--prompt", "Hello", "--max-new", "4"]);
        cmd.args(["--temperature", "0.8", "--top-p", "0.9", "--top-k", "20"])
            .args(["--min-p", "0.01", "--seed", "5"]);
        ok(cmd.output().unwrap()).0
    };
    let stdout = sampled();
    // Same seed, same text.
    let again = sampled();
    assert_eq!(stdout, again);
}

#[test]
fn demo_model_runs_with_no_arguments_and_is_cached() {
    let tmp = tempfile::tempdir().unwrap();
    let run = || {
        bin!()
            .args(["run", "--max-new", "24"])
            .env("SLIPSTREAM_CACHE", tmp.path())
            .output()
            .unwrap()
    };
    let (stdout, stderr) = ok(run());
    assert!(stdout.len() > 40, "demo wrote too little: {stdout:?}");
    assert!(stderr.contains("decode"), "{stderr}");
    let cached: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .collect();
    assert_eq!(
        cached.len(),
        1,
        "one cached model, no leftovers: {cached:?}"
    );
    assert!(cached[0].starts_with("demo-") && cached[0].ends_with(".slip"));
    // Second run reuses the cache and, greedy, writes the same text.
    let (again, _) = ok(run());
    assert_eq!(stdout, again);
}

#[test]
fn bad_inputs_are_clear_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let model = repack_fixture("qwen3_moe", "f32", tmp.path());
    let err = failed(run(&model, &["--prompt-tokens", "1,2,99999"]));
    assert!(err.contains("outside the vocabulary"), "{err}");

    for (flag, value, says) in [
        ("--temperature", "nan", "temperature"),
        ("--top-p", "1.5", "top-p"),
        ("--min-p", "-1", "min-p"),
    ] {
        let err = failed(run(
            &model,
            &["--prompt-tokens", "1,2", &format!("{flag}={value}")],
        ));
        assert!(err.contains(says), "{flag} {value}: {err}");
    }

    let err = failed(run(&tmp.path().join("missing.slip"), &[]));
    assert!(err.contains("manifest.json"), "{err}");

    // A flipped byte in an expert record is caught on read.
    let experts = model.join("experts.bin");
    let mut bytes = std::fs::read(&experts).unwrap();
    bytes[100] ^= 0x10;
    std::fs::write(&experts, bytes).unwrap();
    let err = failed(run(&model, &["--prompt-tokens", "1,2,3"]));
    assert!(err.contains("checksum mismatch"), "{err}");

    let empty = tmp.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let err = failed(
        bin!()
            .args(["repack", "--input"])
            .arg(&empty)
            .arg("--output")
            .arg(tmp.path().join("x.slip"))
            .output()
            .unwrap(),
    );
    assert!(err.contains("config.json"), "{err}");
    assert!(!tmp.path().join("x.slip").exists());
}

#[test]
fn phases_flag_prints_the_per_token_split() {
    let tmp = tempfile::tempdir().unwrap();
    let model = repack_fixture("qwen3_5_moe_fused", "q4", tmp.path());
    let (_, stderr) = ok(run(
        &model,
        &["--prompt-tokens", "5,6,7,8", "--max-new", "6", "--phases"],
    ));
    for part in [
        "[phases] prefill:",
        "[phases] decode: per token",
        "expert FFN",
        "linear attention",
        "full attention",
        "output head",
        "norms+router",
        "expert-read wait",
        "other",
    ] {
        assert!(stderr.contains(part), "missing {part}: {stderr}");
    }
}

#[test]
fn reader_threads_default_follows_the_last_hwbench() {
    let tmp = tempfile::tempdir().unwrap();
    let model = repack_fixture("qwen3_moe", "q4", tmp.path());
    let cache = tmp.path().join("cache");
    let stderr = || {
        let mut cmd = run_command(&model, &["--prompt-tokens", "5,6,7", "--max-new", "2"]);
        ok(cmd.env("SLIPSTREAM_CACHE", &cache).output().unwrap()).1
    };
    assert!(stderr().contains("4 reader threads"));
    std::fs::create_dir_all(&cache).unwrap();
    std::fs::write(cache.join("hwbench.json"), r#"{"best_reader_threads": 2}"#).unwrap();
    assert!(stderr().contains("2 reader threads"));
}

#[test]
fn repack_and_synth_never_replace_what_is_not_a_model() {
    let dir = tempfile::tempdir().unwrap();
    let docs = dir.path().join("mydocs");
    std::fs::create_dir(&docs).unwrap();
    let letter = docs.join("letter.txt");
    std::fs::write(&letter, b"keep").unwrap();
    let input = fixture("qwen3_moe");
    let (input, docs_dir, letter) = (utf8(&input), utf8(&docs), utf8(&letter));
    let synth = ["synth", "--preset", "35b", "--layers", "1"];
    for (args, says) in [
        (
            vec!["repack", "--force", "--input", input, "--output", docs_dir],
            "not a slipstream model",
        ),
        (
            [&synth[..], &["--output", docs_dir]].concat(),
            "not a slipstream model",
        ),
        (
            [&synth[..], &["--format", "gguf", "--output", letter]].concat(),
            "not a GGUF file",
        ),
    ] {
        let e = failed(slipstream(&args));
        assert!(e.contains(says), "{args:?}: {e}");
    }
    assert_eq!(std::fs::read(letter).unwrap(), b"keep");
    assert_eq!(std::fs::read_dir(&docs).unwrap().count(), 1);
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
}

/// Prompt tokens of a one-token `run` with `args`.
fn prompt_tokens_of(model: &Path, dir: &Path, args: &[&str]) -> u64 {
    let stats = dir.join("stats.json");
    let mut cmd = run_command(model, &["--prompt", "Hello there", "--max-new", "1"]);
    cmd.arg("--stats-json").arg(&stats).args(args);
    ok(cmd.output().unwrap());
    read_json(&stats)["stats"]["prompt_tokens"]
        .as_u64()
        .unwrap()
}

#[test]
fn chat_template_flags_and_max_context_checks() {
    let tmp = tempfile::tempdir().unwrap();
    let model = repack_fixture("qwen3_moe", "q4", tmp.path());
    let template = tmp.path().join("t.jinja");
    std::fs::write(
        &template,
        "{% if enable_thinking %}<think>{% endif %}{{ messages[-1].content }}",
    )
    .unwrap();
    let t = utf8(&template);
    let plain = prompt_tokens_of(&model, tmp.path(), &[]);
    let own = prompt_tokens_of(&model, tmp.path(), &["--chat"]);
    let replaced = prompt_tokens_of(&model, tmp.path(), &["--chat", "--chat-template", t]);
    assert_eq!(
        replaced, plain,
        "the file's template renders the bare prompt"
    );
    assert!(
        own > replaced,
        "the model's ChatML template adds its markers"
    );
    let thinking = prompt_tokens_of(
        &model,
        tmp.path(),
        &[
            "--chat",
            "--chat-template",
            t,
            "--chat-template-kwargs",
            r#"{"enable_thinking": true}"#,
        ],
    );
    assert!(thinking > replaced);
    assert_eq!(
        prompt_tokens_of(
            &model,
            tmp.path(),
            &["--chat", "--chat-template", t, "--think"]
        ),
        thinking
    );

    let err = failed(run(&model, &["--chat", "--chat-template-kwargs", "[1]"]));
    assert!(err.contains("--chat-template-kwargs"), "{err}");
    let err = failed(slipstream(&[
        "serve",
        "--port",
        "0",
        "--model",
        utf8(&model),
        "--max-context",
        "100000",
    ]));
    assert!(
        err.contains("--max-context 100000") && err.contains("4096"),
        "{err}"
    );
}

#[test]
fn run_refuses_a_prompt_past_the_models_positions() {
    let tmp = tempfile::tempdir().unwrap();
    let model = repack_fixture("qwen3_moe", "q4", tmp.path());
    let ids = |n: usize| vec!["1"; n].join(",");
    // 4096 positions: 4096 prompt tokens leave no room for a reply.
    let err = failed(run(&model, &["--prompt-tokens", &ids(4096)]));
    assert!(
        err.contains("4096 tokens") && err.contains("4096 positions"),
        "{err}"
    );
    // A text prompt past the limit: refused while it is being counted.
    let long = tmp.path().join("long.txt");
    std::fs::write(&long, "many words of text ".repeat(10_000)).unwrap();
    let err = failed(run(&model, &["--prompt-file", utf8(&long)]));
    assert!(
        err.contains("more than 4095 tokens") && err.contains("4096 positions"),
        "{err}"
    );
    // A file larger than any prompt could be is not read at all.
    let huge = tmp.path().join("huge.txt");
    std::fs::write(&huge, "x".repeat(3 << 20)).unwrap();
    let err = failed(run(&model, &["--prompt-file", utf8(&huge)]));
    assert!(err.contains("larger than 1 MiB"), "{err}");
    // Near the end: the reply is cut to the positions left, with a note.
    let (_, stderr) = ok(run(
        &model,
        &["--prompt-tokens", &ids(4090), "--max-new", "100"],
    ));
    assert!(stderr.contains("--max-new 100 cut to 6"), "{stderr}");
}

#[test]
fn a_blank_api_key_is_refused() {
    for key in ["", "   "] {
        let err = failed(slipstream(&["serve", "--port", "0", "--api-key", key]));
        assert!(err.contains("empty or only whitespace"), "{err:?}");
    }
}

#[test]
fn speculate_flags_keep_the_output_and_print_their_stats() {
    let tmp = tempfile::tempdir().unwrap();
    let model = repack_fixture("qwen3_5_moe_mtp", "f32", tmp.path());
    let repetitive = |extra: &[&str]| {
        let prompt = [
            "--prompt-tokens",
            "5,9,5,9,5,9,5",
            "--max-new",
            "12",
            "--print-ids",
        ];
        ok(run(&model, &[&prompt[..], extra].concat()))
    };
    let (plain, _) = repetitive(&[]);
    for mode in ["mtp", "lookup", "both"] {
        let (out, err) = repetitive(&[
            "--speculate",
            mode,
            "--draft-tokens",
            "3",
            "--speculate-always",
            "--measure-verify",
            "3",
        ]);
        assert_eq!(out, plain, "{mode}");
        assert!(
            err.contains(&format!("[speculate] mode {mode} k 3 | drafted")),
            "{err}"
        );
        assert!(err.contains("[verify] 3 tokens:"), "{err}");
    }
    let plain_model = repack_fixture("qwen3_5_moe_fused", "f32", tmp.path());
    let err = failed(run(
        &plain_model,
        &["--prompt-tokens", "1,2", "--speculate", "mtp"],
    ));
    assert!(err.contains("needs an MTP head"), "{err}");
    let err = failed(slipstream(&["run", "--speculate", "sometimes"]));
    assert!(err.contains("unknown speculation mode"), "{err}");
}

/// `--model FILE.gguf` runs the GGUF in place: the tokens and logits of the
/// same file repacked, bit for bit; the first run builds the checksum
/// table beside the file and says so, the second reuses it.
#[test]
fn a_gguf_runs_in_place_like_its_repack() {
    let tmp = tempfile::tempdir().unwrap();
    let name = "gguf_qwen3next_q8_0";
    let gguf = tmp.path().join("model.gguf");
    std::fs::copy(fixture(name).join("model.gguf"), &gguf).unwrap();
    let prompt = id_list(&reference_ids(name, "prompt_tokens"));
    let run_dumping = |model: &Path, dump: &str| {
        let dump = tmp.path().join(dump);
        let mut cmd = run_command(model, &["--prompt-tokens", &prompt, "--max-new", "6"]);
        cmd.args(["--print-ids", "--expert-cache-slots", "2", "--dump-logits"])
            .arg(&dump)
            .env("SLIPSTREAM_CACHE", tmp.path().join("cache"));
        let (stdout, stderr) = ok(cmd.output().unwrap());
        (stdout, stderr, std::fs::read(&dump).unwrap())
    };
    let (ids, first, logits) = run_dumping(&gguf, "a.npy");
    assert!(first.contains("checksum table written to"), "{first}");
    assert!(tmp
        .path()
        .join("model.gguf.slipstream-index.json")
        .is_file());
    let (again, second, _) = run_dumping(&gguf, "b.npy");
    assert_eq!(again, ids);
    assert!(!second.contains("checksum table"), "{second}");
    let slip = tmp.path().join("m.slip");
    ok(bin!()
        .args(["repack", "--input"])
        .arg(&gguf)
        .arg("--output")
        .arg(&slip)
        .output()
        .unwrap());
    let (repacked_ids, _, repacked_logits) = run_dumping(&slip, "c.npy");
    assert_eq!(repacked_ids, ids);
    assert!(repacked_logits == logits, "logits differ from the repack's");
}
