//! Progress bars on a terminal: one `MultiProgress` owns every bar of a
//! run, so each bar is drawn only through it and cleared when it finishes
//! (no stale first frames left under the summary), and warnings printed
//! while a bar is up are written above it instead of through it.
//!
//! Off a terminal (or with --quiet / --json) nothing is drawn at all.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};

/// How often the counters are polled and the bars redrawn.
const TICK: Duration = Duration::from_millis(100);
const DRAW_HZ: u8 = 8;

/// The bars of one run; inert when `enabled` is false.
pub struct Bars {
    multi: Option<MultiProgress>,
}

/// A bar on screen and the thread that feeds it from shared counters.
pub struct Live {
    bar: ProgressBar,
    feeder: JoinHandle<()>,
    stop: Arc<AtomicBool>,
}

impl Bars {
    pub fn new(enabled: bool) -> Bars {
        let multi = enabled
            .then(|| MultiProgress::with_draw_target(ProgressDrawTarget::stderr_with_hz(DRAW_HZ)));
        Bars { multi }
    }

    /// Shows a bar (`len` None for a spinner) with `template`, and calls
    /// `feed` every tick until [`Bars::finish`], once more at the end.
    pub fn show(
        &self,
        len: Option<u64>,
        template: &str,
        prefix: &'static str,
        feed: impl Fn(&ProgressBar) + Send + 'static,
    ) -> Option<Live> {
        let multi = self.multi.as_ref()?;
        // Built hidden and styled before it joins the MultiProgress: a bar
        // drawn to its own target first would leave that frame behind.
        let bar = ProgressBar::with_draw_target(len, ProgressDrawTarget::hidden());
        let style = ProgressStyle::with_template(template)
            .expect("progress template")
            .progress_chars("=> ");
        bar.set_style(style);
        bar.set_prefix(prefix);
        let bar = multi.add(bar);
        let stop = Arc::new(AtomicBool::new(false));
        let (b2, s2) = (bar.clone(), stop.clone());
        let feeder = std::thread::spawn(move || {
            while !s2.load(Ordering::Relaxed) {
                feed(&b2);
                if b2.length().is_none() {
                    b2.tick();
                }
                std::thread::sleep(TICK);
            }
            feed(&b2);
        });
        Some(Live { bar, feeder, stop })
    }

    /// Stops feeding `live` and erases it from the screen.
    pub fn finish(&self, live: Option<Live>) {
        let Some(l) = live else { return };
        l.stop.store(true, Ordering::Relaxed);
        let _ = l.feeder.join();
        l.bar.finish_and_clear();
        if let Some(m) = &self.multi {
            m.remove(&l.bar);
        }
    }

    /// Prints a line on stderr above the bars.
    pub fn eprintln(&self, line: &str) {
        match &self.multi {
            Some(m) => m.suspend(|| errln!("{line}")),
            None => errln!("{line}"),
        }
    }
}
