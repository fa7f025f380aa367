//! Error text as the user sees it. libtorch's exceptions carry a C++ backtrace of twenty or
//! more frames (`Exception raised from F at FILE:LINE (most recent call first):` then
//! `frame #N: ...`); the first line of the message and where it was raised are what a user
//! needs. The frames are kept for `host --debug`.

/// `text` with each libtorch backtrace folded into `[libtorch: F at FILE:LINE]` after the
/// message it belongs to, unless `debug`.
pub fn tidy(text: &str, debug: bool) -> String {
    if debug || !text.contains("Exception raised from ") {
        return text.to_string();
    }
    // A panic's message shows the error's Debug form (`Torch("...\\nframe #0: ...")`): its line
    // breaks are escaped.
    let text = if text.contains("\\nException raised from ") { text.replace("\\n", "\n") } else { text.to_string() };
    let mut out: Vec<String> = Vec::new();
    let mut folded = false;
    for line in text.lines() {
        let trimmed = line.trim_start();
        if let Some(rest) = trimmed.strip_prefix("Exception raised from ") {
            let place = rest.trim_end_matches(':').trim_end_matches("(most recent call first)").trim();
            let place = short_source_path(place);
            match out.last_mut() {
                Some(last) => last.push_str(&format!(" [libtorch: {place}]")),
                None => out.push(format!("[libtorch: {place}]")),
            }
            folded = true;
        } else if trimmed.starts_with("frame #") || trimmed.is_empty() && folded {
            continue;
        } else if folded && trimmed.starts_with('"') && out.last().is_some() {
            // The rest of an escaped payload (`")`) closes the line it opened.
            out.last_mut().expect("checked").push_str(trimmed);
        } else {
            out.push(line.to_string());
        }
    }
    let mut tidy = out.join("\n");
    if folded {
        tidy.push_str("\n(libtorch's C++ backtrace left out: run with --debug to see it)");
    }
    tidy
}

/// `f at /pytorch/aten/src/ATen/native/X.cpp:12` → `f at aten/src/ATen/native/X.cpp:12`: the
/// build machine's checkout prefix says nothing.
fn short_source_path(place: &str) -> String {
    match place.find("/aten/").or_else(|| place.find("/c10/")).or_else(|| place.find("/torch/")) {
        Some(i) => {
            let (head, tail) = place.split_at(i);
            let func = head.rsplit_once(" at ").map_or(head, |(f, _)| f);
            format!("{func} at {}", &tail[1..])
        }
        None => place.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind, Tensor};

    /// A real libtorch error, as a plugin's panicking tch call reports it.
    #[test]
    fn libtorch_backtraces_fold_into_one_place() {
        let a = Tensor::ones([2, 3], (Kind::Float, Device::Cpu));
        let err = a.f_matmul(&Tensor::ones([4, 4], (Kind::Float, Device::Cpu))).unwrap_err().to_string();
        assert!(err.contains("frame #"), "libtorch's message carries its backtrace: {err}");
        let text = format!("plugin \"faulty\" (/x/libfaulty.so): encode failed: {err}");
        let tidy = tidy(&text, false);
        assert!(!tidy.contains("frame #"), "{tidy}");
        assert!(tidy.contains("cannot be multiplied") && tidy.contains("[libtorch: ") && tidy.contains(".cpp:"), "{tidy}");
        assert!(tidy.lines().count() <= 3, "{tidy}");
        assert_eq!(super::tidy(&text, true), text, "--debug keeps everything");
        assert_eq!(super::tidy("plain error", false), "plain error");
        // As a panic inside a plugin reports it: the Debug form, line breaks escaped.
        let panicked = format!("panicked: called `Result::unwrap()` on an `Err` value: Torch({:?})", err);
        let tidy = super::tidy(&panicked, false);
        assert!(!tidy.contains("frame #") && tidy.contains("cannot be multiplied") && tidy.contains("[libtorch: "), "{tidy}");
        assert!(tidy.lines().count() <= 2, "{tidy}");
    }
}
