//! PNG charts (plotters, bitmap backend) for `host analyze`: one line per series over shared
//! x values, and a histogram. Text uses DejaVu Sans embedded in the binary, so plots look the
//! same on machines without fonts.

use anyhow::{anyhow, bail, Result};
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;
use std::path::Path;
use std::sync::OnceLock;

const SIZE: (u32, u32) = (960, 600);

fn register_font() -> Result<()> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let ok = *REGISTERED.get_or_init(|| plotters::style::register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular()).is_ok());
    if ok {
        Ok(())
    } else {
        bail!("the embedded font is invalid")
    }
}

/// Draw on an RGB buffer, then write it as a PNG atomically (plotters' own encoder picks the
/// format from the file name, which a temporary name does not have).
fn draw_png(path: &Path, draw: impl FnOnce(DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>) -> Result<()>) -> Result<()> {
    let mut buffer = vec![0u8; (SIZE.0 * SIZE.1 * 3) as usize];
    draw(BitMapBackend::with_buffer(&mut buffer, SIZE).into_drawing_area())?;
    let image = image::RgbImage::from_raw(SIZE.0, SIZE.1, buffer).ok_or_else(|| anyhow!("plot buffer of the wrong size"))?;
    rak_core::fsutil::write_atomically(path, |tmp| image.save_with_format(tmp, image::ImageFormat::Png).map_err(|e| anyhow!("{}: {e}", path.display())))
}

fn range(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if !lo.is_finite() || !hi.is_finite() {
        return (0.0, 1.0);
    }
    if hi > lo {
        (lo, hi)
    } else {
        (lo - 0.5, hi + 0.5)
    }
}

type Chart<'a, 'b> = ChartContext<'a, BitMapBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// The frame both charts share (white background, caption, axes with their labels), `draw`
/// on it, then a legend when `legend` asks, written as a PNG to `path`.
fn chart(path: &Path, title: &str, x_label: &str, y_label: &str, x: (f64, f64), y: (f64, f64), legend: bool, draw: impl FnOnce(&mut Chart) -> Result<()>) -> Result<()> {
    register_font()?;
    draw_png(path, |root| {
        root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 24))
            .margin(16)
            .x_label_area_size(48)
            .y_label_area_size(80)
            .build_cartesian_2d(x.0..x.1, y.0..y.1)
            .map_err(|e| anyhow!("{e}"))?;
        chart.configure_mesh().x_desc(x_label).y_desc(y_label).label_style(("sans-serif", 16)).draw().map_err(|e| anyhow!("{e}"))?;
        draw(&mut chart)?;
        if legend {
            chart.configure_series_labels().background_style(WHITE.mix(0.85)).border_style(BLACK).label_font(("sans-serif", 18)).draw().map_err(|e| anyhow!("{e}"))?;
        }
        root.present().map_err(|e| anyhow!("{e}"))?;
        Ok(())
    })
}

/// Lines `(label, ys)` over `xs`, with a legend; written atomically to `path`.
pub fn lines(path: &Path, title: &str, x_label: &str, y_label: &str, xs: &[f64], series: &[(String, Vec<f64>)]) -> Result<()> {
    if series.iter().any(|(_, ys)| ys.len() != xs.len()) {
        bail!("plot {title}: series lengths differ from the x values");
    }
    let x = range(xs.iter().copied());
    let (_, y1) = range(series.iter().flat_map(|(_, ys)| ys.iter().copied()));
    chart(path, title, x_label, y_label, x, (0.0, y1 * 1.05), true, |chart| {
        for (i, (label, ys)) in series.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba().stroke_width(2);
            chart
                .draw_series(LineSeries::new(xs.iter().copied().zip(ys.iter().copied()), color))
                .map_err(|e| anyhow!("{e}"))?
                .label(label.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], color));
        }
        Ok(())
    })
}

/// A histogram of `counts` over equal bins of `[lo, hi]`, with an optional marked x value
/// (a threshold) drawn as a red line.
pub fn histogram(path: &Path, title: &str, x_label: &str, y_label: &str, lo: f64, hi: f64, counts: &[f64], mark: Option<(f64, &str)>) -> Result<()> {
    if counts.is_empty() || hi <= lo {
        bail!("plot {title}: no bins");
    }
    let width = (hi - lo) / counts.len() as f64;
    let top = counts.iter().copied().fold(0.0, f64::max).max(1e-12) * 1.05;
    chart(path, title, x_label, y_label, (lo, hi), (0.0, top), mark.is_some(), |chart| {
        chart
            .draw_series(counts.iter().enumerate().map(|(i, &c)| {
                let x = lo + i as f64 * width;
                Rectangle::new([(x, 0.0), (x + width * 0.95, c)], BLUE.mix(0.6).filled())
            }))
            .map_err(|e| anyhow!("{e}"))?;
        if let Some((x, label)) = mark {
            chart
                .draw_series(LineSeries::new([(x, 0.0), (x, top)], RED.stroke_width(2)))
                .map_err(|e| anyhow!("{e}"))?
                .label(label)
                .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], RED.stroke_width(2)));
        }
        Ok(())
    })
}
