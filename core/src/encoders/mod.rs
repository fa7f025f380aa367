//! Ready-made [`Encoder`](crate::plugin::Encoder) implementations the built-in encoder plugins
//! wrap (`dpr`, `taser`; `taco` over T5), kept in core so third parties can reuse them.

pub mod ahead;
pub mod bert;
pub mod files;
pub mod taco;

use anyhow::{bail, Result};
use tch::Device;

/// Separates a passage's title from its text in the strings handed to `Encoder::encode`
/// (ASCII unit separator). Encoders that read titles split on it; others may treat it as
/// whitespace.
pub const TITLE_SEPARATOR: char = '\u{1f}';

/// Join a title and a text into one passage string for `Encoder::encode`.
pub fn passage_string(title: &str, text: &str) -> String {
    if title.is_empty() {
        text.to_string()
    } else {
        format!("{title}{TITLE_SEPARATOR}{text}")
    }
}

/// Parse `cpu`, `cuda` or `cuda:N`.
pub fn parse_device(name: &str) -> Result<Device> {
    match name {
        "cpu" => Ok(Device::Cpu),
        "cuda" => Ok(Device::Cuda(0)),
        _ => match name.strip_prefix("cuda:").and_then(|n| n.parse().ok()) {
            Some(i) => Ok(Device::Cuda(i)),
            None => bail!("unknown device {name:?}: expected cpu, cuda or cuda:N"),
        },
    }
}

/// Fail early, with a clear message, when CUDA is asked for and absent.
pub fn check_device(device: Device) -> Result<()> {
    if let Device::Cuda(i) = device {
        let n = tch::Cuda::device_count();
        if !tch::Cuda::is_available() || i as i64 >= n {
            bail!("device cuda:{i} requested but this machine has {n} CUDA device(s)");
        }
    }
    Ok(())
}
