//! `mpc train --plot FILE.svg`: the loss (training and evaluation) and the learning rate against
//! the step, drawn when the run ends.

use std::path::Path;

use crate::{Error, Result};

/// A step's numbers, as the run read them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepPoint {
    /// The count of batches done after it.
    pub step: usize,
    pub loss: f32,
    pub lr: f32,
    pub skipped: bool,
}

/// Draws two panels, one above the other: the training loss of each step that was not skipped
/// (a line) and the evaluation loss after each epoch (points), then the learning rate. Written to
/// `path` as SVG, atomically.
pub fn training_curves(steps: &[StepPoint], evals: &[(usize, f64)], title: &str, path: &Path) -> Result<()> {
    use plotters::prelude::*;
    let first = steps.first().map_or(0, |s| s.step.saturating_sub(1)) as f64;
    let last = steps.last().map_or(1, |s| s.step).max(evals.last().map_or(0, |e| e.0)) as f64;
    let x = first..last.max(first + 1.0);
    let finite = |v: f64| v.is_finite().then_some(v);
    let losses: Vec<(f64, f64)> =
        steps.iter().filter(|s| !s.skipped).filter_map(|s| Some((s.step as f64, finite(f64::from(s.loss))?))).collect();
    let evals: Vec<(f64, f64)> = evals.iter().filter_map(|&(s, l)| Some((s as f64, finite(l)?))).collect();
    let top = losses.iter().chain(&evals).map(|p| p.1).fold(0.0, f64::max).max(1e-9) * 1.05;
    let rates: Vec<(f64, f64)> = steps.iter().map(|s| (s.step as f64, f64::from(s.lr))).collect();
    let lr_top = rates.iter().map(|p| p.1).fold(0.0, f64::max).max(1e-12) * 1.05;
    let mut svg = String::new();
    let draw = |svg: &mut String| -> std::result::Result<(), Box<dyn std::error::Error>> {
        let root = SVGBackend::with_string(svg, (900, 640)).into_drawing_area();
        root.fill(&WHITE)?;
        let root = root.titled(title, ("sans-serif", 18))?;
        let (upper, lower) = root.split_vertically(400);
        let mut chart = ChartBuilder::on(&upper)
            .margin(12)
            .x_label_area_size(30)
            .y_label_area_size(60)
            .build_cartesian_2d(x.clone(), 0.0..top)?;
        chart.configure_mesh().y_desc("loss").draw()?;
        chart
            .draw_series(LineSeries::new(losses.iter().copied(), BLUE.stroke_width(1)))?
            .label("training loss (each step)")
            .legend(|(x, y)| PathElement::new([(x, y), (x + 16, y)], BLUE));
        chart
            .draw_series(evals.iter().map(|&p| Circle::new(p, 4, RED.filled())))?
            .label("evaluation loss")
            .legend(|(x, y)| Circle::new((x + 8, y), 4, RED.filled()));
        chart.configure_series_labels().border_style(BLACK).background_style(WHITE.mix(0.8)).draw()?;
        let mut chart = ChartBuilder::on(&lower)
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(x.clone(), 0.0..lr_top)?;
        chart
            .configure_mesh()
            .x_desc("step")
            .y_desc("learning rate")
            .y_label_formatter(&|v| format!("{v:.1e}"))
            .draw()?;
        chart.draw_series(LineSeries::new(rates.iter().copied(), BLACK.stroke_width(1)))?;
        root.present()?;
        Ok(())
    };
    draw(&mut svg).map_err(|e| Error::Usage(format!("{}: cannot draw: {e}", path.display())))?;
    crate::write_atomic(path, svg.as_bytes())
}
