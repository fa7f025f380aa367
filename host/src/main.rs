//! `host`: the retrieval-augmentation toolkit's one binary.

use abi_stable::std_types::RStr;
use anyhow::Result;
use clap::{Parser, Subcommand};
use rak_host::loader::{self, Module};
use rak_host::{commands, host_api, proxy, search_path, Registry, Source};
use serde_json::json;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "host", version, about = "Retrieval-augmentation toolkit: multitask dense retrieval, AAR, augmentation")]
struct Cli {
    /// Load this plugin file (repeatable); searched before RAK_PLUGIN_PATH and the host's folder.
    #[arg(long = "plugin", global = true, value_name = "PATH")]
    plugins: Vec<PathBuf>,
    /// Show errors whole, libtorch's C++ backtraces included.
    #[arg(long, global = true, env = "RAK_DEBUG")]
    debug: bool,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Show the libtorch build, CUDA devices and the plugin search path.
    Doctor,
    /// List or inspect plugins.
    #[command(subcommand)]
    Plugins(PluginsCmd),
    /// Embed a JSONL file of passages or queries into embeddings.npy + ids.txt.
    Encode(commands::encode::EncodeArgs),
    /// Build or describe an index (flat, hnsw, bm25).
    #[command(subcommand)]
    Index(commands::index::IndexCmd),
    /// Retrieve the top-k passages for each query into a TREC run.
    Search(commands::search::SearchArgs),
    /// Train a dense retriever on several tasks (TOML recipe; flags override it).
    Train(commands::train::TrainArgs),
    /// Task-specialisation analysis of a trained model: sensitivities, task entropy, commitment (JSON + PNG plots).
    Analyze(commands::analyze::AnalyzeArgs),
    /// Answer questions with a target LM (HTTP connector or local reader), passages retrieved into its prompt; measure accuracy.
    Augment(commands::augment::AugmentArgs),
    /// Evaluate TREC runs against qrels: R-precision (page, passage), recall, MRR, nDCG, answer accuracy.
    Eval(commands::eval::EvalArgs),
    /// Serve a retriever over HTTP: /v1/embeddings, /search, and an OpenAI-compatible proxy to a target LM that retrieves passages into each request.
    Serve(commands::serve::ServeArgs),
    /// A subcommand provided by a command plugin.
    #[command(external_subcommand)]
    External(Vec<String>),
}

#[derive(Subcommand)]
enum PluginsCmd {
    /// Every plugin found on the search path: name, kind, version, file.
    List,
    /// Every field of one plugin file's metadata and whether this host can load it.
    Inspect { path: PathBuf },
}

fn main() -> ExitCode {
    // Any panic in the host is a bug; report it in one line rather than a backtrace.
    std::panic::set_hook(Box::new(|info| {
        eprintln!("error: internal error (please report): {}", rak_core::abi::panic_message(info.payload()));
    }));
    rak_core::malloc::keep_freed_buffers();
    let cli = Cli::parse();
    let debug = cli.debug;
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {}", rak_host::errors::tidy(&format!("{e:#}"), debug));
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<ExitCode> {
    let sources = search_path(&cli.plugins);
    match cli.command {
        Cmd::Doctor => doctor(&sources),
        Cmd::Plugins(PluginsCmd::List) => list(&sources),
        Cmd::Plugins(PluginsCmd::Inspect { path }) => inspect(&path),
        Cmd::Encode(args) => {
            commands::encode::run(&Registry::discover(&sources)?, &args)?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Index(cmd) => {
            let out = commands::index::run(&cmd)?;
            println!("{}", serde_json::to_string_pretty(&out)?);
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Search(args) => {
            commands::search::run(&Registry::discover(&sources)?, &args)?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Train(args) => {
            let out = commands::train::run(&Registry::discover(&sources)?, &args)?;
            // Null: a data-parallel process other than rank 0, which has nothing to say.
            if !out.is_null() {
                println!("{}", serde_json::to_string_pretty(&out)?);
            }
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Analyze(args) => {
            let out = commands::analyze::run(&Registry::discover(&sources)?, &args)?;
            println!("{}", serde_json::to_string_pretty(&out)?);
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Augment(args) => {
            let (summary, failed) = commands::augment::run(&Registry::discover(&sources)?, &args)?;
            println!("{}", serde_json::to_string_pretty(&summary)?);
            Ok(if failed { ExitCode::from(commands::augment::SOME_FAILED) } else { ExitCode::SUCCESS })
        }
        Cmd::Eval(args) => {
            let out = commands::eval::run(&args)?;
            println!("{}", serde_json::to_string_pretty(&out)?);
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Serve(args) => {
            commands::serve::run(&Registry::discover(&sources)?, &args)?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::External(args) => external(&sources, args),
    }
}

fn doctor(sources: &[Source]) -> Result<ExitCode> {
    println!("host            {}", env!("CARGO_PKG_VERSION"));
    println!("plugin ABI      {}", rak_core::abi::ABI_VERSION);
    println!("tch             {}", rak_core::TCH_VERSION);
    println!("libtorch        {}", rak_core::LIBTORCH_VERSION);
    println!("target          {}", rak_core::TARGET);
    println!("cuda available  {}", tch::Cuda::is_available());
    println!("cuda devices    {}", tch::Cuda::device_count());
    println!("cudnn available {}", tch::Cuda::cudnn_is_available());
    println!("cpu threads     {}", tch::get_num_threads());
    println!("plugin search path:");
    for s in sources {
        match s {
            Source::File(p) => println!("  file {}", p.display()),
            Source::Dir(p) => println!("  dir  {}", p.display()),
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn list(sources: &[Source]) -> Result<ExitCode> {
    let registry = Registry::discover(sources)?;
    println!("{:<16} {:<10} {:<10} FILE", "NAME", "KIND", "VERSION");
    for p in registry.iter() {
        println!("{:<16} {:<10} {:<10} {}", p.header.name, p.header.kind, p.header.version, p.path.display());
    }
    for s in &registry.skipped {
        eprintln!("warning: skipped {s}");
    }
    Ok(ExitCode::SUCCESS)
}

fn inspect(path: &PathBuf) -> Result<ExitCode> {
    let header = loader::inspect(path)?;
    let incompatibility = header.incompatibility();
    let mut out = json!({
        "file": path,
        "metadata": header,
        "host": host_side(),
        "compatible": incompatibility.is_none(),
    });
    if let Some(why) = &incompatibility {
        out["reason"] = json!(why);
        println!("{}", serde_json::to_string_pretty(&out)?);
        anyhow::bail!("{}: incompatible plugin {:?}: {why}", path.display(), header.name);
    }
    let plugin = loader::load(path)?;
    out["settings"] = proxy::settings_schema(&plugin);
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(ExitCode::SUCCESS)
}

/// The fields of this host that a plugin header must match.
fn host_side() -> serde_json::Value {
    let h = rak_core::abi::HeaderInfo::this_build();
    json!({"abi_version": h.abi_version, "tch_version": h.tch_version, "libtorch_version": h.libtorch_version, "target": h.target})
}

fn external(sources: &[Source], args: Vec<String>) -> Result<ExitCode> {
    let (name, rest) = args.split_first().expect("clap gives the subcommand name");
    let registry = Registry::discover(sources)?;
    let Some(plugin) = registry.command(name) else {
        anyhow::bail!("unknown command {name:?}; run `host --help`, or `host plugins list` for plugin commands");
    };
    let Module::Command(m) = plugin.module else { unreachable!("command() checks the kind") };
    let argv: Vec<RStr<'_>> = rest.iter().map(|s| s.as_str().into()).collect();
    let services = host_api::Services::new(&registry);
    let result = services.with_api(|api| (m.run())(argv.as_slice().into(), api).into_result());
    let code = result.map_err(|e| anyhow::anyhow!("command {name:?} ({}) failed: {e}", plugin.path.display()))?;
    exit_code(name, code)
}

/// A command's return value as the process's exit status. Only 0..=255 exist; anything else
/// (e.g. -1, which a cast would turn into 255 and a clamp into success) is a failure.
fn exit_code(name: &str, code: i32) -> Result<ExitCode> {
    match u8::try_from(code) {
        Ok(c) => Ok(ExitCode::from(c)),
        Err(_) => anyhow::bail!("command {name:?} returned exit code {code}, outside 0..=255"),
    }
}
