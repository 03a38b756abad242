//! `gpushare-mangen OUTDIR`: writes the man pages of gpushare's installed binaries and
//! gpusharectl's shell completions under OUTDIR, for the Debian packages:
//!
//! - `man8/gpushared.8`, `man8/gpushare-extender.8`;
//! - `man1/gpusharectl.1`, `man1/kubectl-inspect-gpushare.1`;
//! - `completions/gpusharectl.bash`, `completions/_gpusharectl` (zsh),
//!   `completions/gpusharectl.fish`.
//!
//! Every page is generated from its binary's own clap definition ([`gpushared::cli`],
//! [`gpushare_extender::cli`], [`gpushared::ctl`]), so the pages cannot drift from the flags.
//! The pages are uncompressed roff; the packaging script compresses them.

mod pages;

use std::path::PathBuf;

use anyhow::Context as _;
use clap::Parser as _;

/// Writes gpushare's man pages and gpusharectl's shell completions, for the Debian packages.
#[derive(clap::Parser, Debug)]
#[command(name = "gpushare-mangen", version)]
struct Args {
    /// The output directory: man1/, man8/ and completions/ are created in it.
    #[arg(value_name = "OUTDIR")]
    out_dir: PathBuf,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    for file in pages::all().context("rendering the man pages")? {
        let path = args.out_dir.join(file.path);
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        std::fs::write(&path, &file.contents).with_context(|| format!("writing {}", path.display()))?;
        println!("{}", path.display());
    }
    Ok(())
}
