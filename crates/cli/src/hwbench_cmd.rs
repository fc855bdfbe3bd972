//! `slipstream hwbench`: this machine's ceilings (SSD, memory, kernels,
//! sustained load) as a table and optionally JSON.

use std::path::PathBuf;

use anyhow::Context;

#[derive(clap::Args, Debug, Clone)]
pub struct HwbenchArgs {
    /// Directory for the scratch file (put it on the disk that holds the models)
    #[arg(long, default_value = ".")]
    pub scratch_dir: PathBuf,
    /// Size of the scratch file of unique data in GiB (each SSD test reads a
    /// fresh share of it)
    #[arg(long, default_value_t = 8.0)]
    pub scratch_gb: f64,
    /// Seconds of sustained load to look for sag (0 skips)
    #[arg(long, default_value_t = 60.0)]
    pub sustain_secs: f64,
    /// Small sizes, a few seconds in all (ignores --scratch-gb and --sustain-secs)
    #[arg(long)]
    pub quick: bool,
    /// Skip the SSD tests
    #[arg(long)]
    pub no_ssd: bool,
    /// Reader-thread counts for the SSD tests, comma separated
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    pub io_threads: Vec<usize>,
    /// Write the full report as JSON to this file
    #[arg(long)]
    pub json: Option<PathBuf>,
}

pub fn hwbench_command(args: HwbenchArgs) -> anyhow::Result<()> {
    let mut cfg = if args.quick {
        slipstream_hwbench::Config::quick(args.scratch_dir.clone())
    } else {
        slipstream_hwbench::Config::full(
            args.scratch_dir.clone(),
            args.scratch_gb,
            args.sustain_secs,
        )
    };
    cfg.skip_ssd = args.no_ssd;
    if !args.quick {
        cfg.io_threads = args.io_threads.clone();
    }
    anyhow::ensure!(
        !cfg.io_threads.is_empty() && cfg.io_threads.iter().all(|&t| t > 0),
        "--io-threads needs positive counts"
    );
    let report = slipstream_hwbench::run(&cfg, &mut |l| eprintln!("[hwbench] {l}"))
        .with_context(|| format!("hwbench (scratch dir {})", args.scratch_dir.display()))?;
    print!("{}", report.table());
    if !args.quick && report.best_reader_threads.is_some() {
        // Later runs take their default reader-thread count from here.
        let path = crate::hwbench_report_path();
        let tmp = path.with_extension("json.tmp");
        let saved = path
            .parent()
            .map_or(Ok(()), std::fs::create_dir_all)
            .and_then(|_| std::fs::write(&tmp, serde_json::to_string_pretty(&report)?))
            .and_then(|_| std::fs::rename(&tmp, &path));
        match saved {
            Ok(()) => eprintln!(
                "[hwbench] saved {}: `run` and `serve` now default to {} reader threads",
                path.display(),
                crate::default_io_threads()
            ),
            Err(e) => eprintln!("[hwbench] could not save {}: {e}", path.display()),
        }
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("[hwbench] wrote {}", path.display());
    }
    Ok(())
}
