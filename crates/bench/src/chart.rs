//! Line charts as SVG and PNG from one layout.
//!
//! Both renderers draw through [`Painter`], so the SVG and the PNG show the
//! same marks. The PNG uses `embedded-graphics` (its built-in bitmap fonts,
//! so no system font or fontconfig is needed) and the `png` encoder: it
//! builds anywhere the Rust toolchain does.

use std::convert::Infallible;

use anyhow::{Context, Result};
use embedded_graphics::mono_font::ascii::{FONT_6X10, FONT_7X13, FONT_9X15_BOLD};
use embedded_graphics::mono_font::MonoTextStyle;
use embedded_graphics::pixelcolor::Rgb888;
use embedded_graphics::prelude::*;
use embedded_graphics::primitives::{Circle, Line, PrimitiveStyle, Rectangle};
use embedded_graphics::text::{Alignment, Text};

/// One line of points.
#[derive(Clone, Debug)]
pub struct Series {
    pub name: String,
    /// (x, y) in data units; drawn in the order given.
    pub points: Vec<(f64, f64)>,
}

/// A chart: axes, titles and series.
#[derive(Clone, Debug)]
pub struct Chart {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    /// Logarithmic x axis (base 2), ticks at the data's x values.
    pub x_log: bool,
    pub series: Vec<Series>,
}

const W: i32 = 900;
const H: i32 = 460;
const LEFT: i32 = 70;
const RIGHT: i32 = W - 310;
const TOP: i32 = 50;
const BOTTOM: i32 = H - 60;

const PALETTE: [(u8, u8, u8); 10] = [
    (31, 119, 180),
    (214, 39, 40),
    (44, 160, 44),
    (255, 127, 14),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (127, 127, 127),
    (188, 189, 34),
    (23, 190, 207),
];

#[derive(Clone, Copy, PartialEq)]
enum Anchor {
    Start,
    Middle,
    End,
}

#[derive(Clone, Copy)]
enum Size {
    Small,
    Normal,
    Title,
}

/// What a chart is drawn with.
trait Painter {
    fn line(&mut self, a: (i32, i32), b: (i32, i32), rgb: (u8, u8, u8), width: u32);
    fn dot(&mut self, c: (i32, i32), diameter: u32, rgb: (u8, u8, u8));
    /// `y` is the text baseline.
    fn text(&mut self, x: i32, y: i32, s: &str, anchor: Anchor, size: Size, rgb: (u8, u8, u8));
}

/// Axis mapping from data to pixels.
struct Axes {
    x_min: f64,
    x_max: f64,
    y_max: f64,
    x_log: bool,
}

impl Axes {
    fn new(chart: &Chart) -> Self {
        let pts: Vec<(f64, f64)> = chart
            .series
            .iter()
            .flat_map(|s| s.points.iter().copied())
            .filter(|(x, y)| x.is_finite() && y.is_finite() && (!chart.x_log || *x > 0.0))
            .collect();
        let tx = |x: f64| if chart.x_log { x.log2() } else { x };
        let (mut x_min, mut x_max) = pts.iter().fold((f64::MAX, f64::MIN), |(a, b), p| {
            (a.min(tx(p.0)), b.max(tx(p.0)))
        });
        if pts.is_empty() {
            (x_min, x_max) = (0.0, 1.0);
        }
        if !chart.x_log {
            x_min = x_min.min(0.0);
        }
        if (x_max - x_min).abs() < 1e-12 {
            x_min -= 1.0;
            x_max += 1.0;
        } else {
            let pad = (x_max - x_min) * 0.06;
            if chart.x_log {
                x_min -= pad;
            }
            x_max += pad;
        }
        let y_top = pts.iter().map(|p| p.1).fold(0.0f64, f64::max);
        let y_max = nice_ceiling(if y_top > 0.0 { y_top * 1.08 } else { 1.0 });
        Self {
            x_min,
            x_max,
            y_max,
            x_log: chart.x_log,
        }
    }

    fn px(&self, x: f64) -> i32 {
        let v = if self.x_log { x.log2() } else { x };
        LEFT + ((v - self.x_min) / (self.x_max - self.x_min) * f64::from(RIGHT - LEFT)).round()
            as i32
    }

    fn py(&self, y: f64) -> i32 {
        BOTTOM - (y / self.y_max * f64::from(BOTTOM - TOP)).round() as i32
    }
}

/// Smallest 1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6 or 8 x 10^k at or above `v`.
fn nice_ceiling(v: f64) -> f64 {
    let e = 10f64.powf(v.log10().floor());
    for m in [1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0] {
        if m * e >= v - 1e-12 {
            return m * e;
        }
    }
    10.0 * e
}

/// `1024` -> `1k`, `3072` -> `3k`, `0.5` -> `0.5`.
fn tick_label(v: f64) -> String {
    if v >= 1000.0 && (v / 1024.0).fract() == 0.0 {
        format!("{}k", v / 1024.0)
    } else if v >= 1000.0 {
        format!("{:.1}k", v / 1000.0)
    } else if v.fract() == 0.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

fn draw(chart: &Chart, p: &mut dyn Painter) {
    let ax = Axes::new(chart);
    let black = (0, 0, 0);
    let grey = (200, 200, 200);
    p.text(LEFT, 24, &chart.title, Anchor::Start, Size::Title, black);
    p.text(
        LEFT,
        TOP - 10,
        &chart.y_label,
        Anchor::Start,
        Size::Normal,
        black,
    );
    p.text(
        (LEFT + RIGHT) / 2,
        H - 18,
        &chart.x_label,
        Anchor::Middle,
        Size::Normal,
        black,
    );
    // y grid and ticks
    for k in 0..=5 {
        let v = ax.y_max * f64::from(k) / 5.0;
        let y = ax.py(v);
        p.line((LEFT, y), (RIGHT, y), grey, 1);
        p.text(
            LEFT - 6,
            y + 4,
            &tick_label(v),
            Anchor::End,
            Size::Small,
            black,
        );
    }
    // x ticks: the data's x values on a log axis or where they are few
    // whole numbers (request numbers), else six even steps
    let mut data_xs: Vec<f64> = chart
        .series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.0))
        .filter(|x| x.is_finite() && (!ax.x_log || *x > 0.0))
        .collect();
    data_xs.sort_by(f64::total_cmp);
    data_xs.dedup();
    let whole =
        !data_xs.is_empty() && data_xs.len() <= 40 && data_xs.iter().all(|x| x.fract() == 0.0);
    let xs: Vec<f64> = if ax.x_log || whole {
        data_xs
    } else {
        (0..=5)
            .map(|k| ax.x_min + (ax.x_max - ax.x_min) * f64::from(k) / 5.0)
            .collect()
    };
    for x in xs {
        let px = ax.px(x);
        p.line((px, BOTTOM), (px, BOTTOM + 5), black, 1);
        p.text(
            px,
            BOTTOM + 18,
            &tick_label(x),
            Anchor::Middle,
            Size::Small,
            black,
        );
    }
    p.line((LEFT, BOTTOM), (RIGHT, BOTTOM), black, 1);
    p.line((LEFT, BOTTOM), (LEFT, TOP), black, 1);
    if chart.series.iter().all(|s| s.points.is_empty()) {
        p.text(
            (LEFT + RIGHT) / 2,
            (TOP + BOTTOM) / 2,
            "no finished runs",
            Anchor::Middle,
            Size::Normal,
            (120, 120, 120),
        );
    }
    for (i, s) in chart.series.iter().enumerate() {
        let rgb = PALETTE[i % PALETTE.len()];
        let pts: Vec<(i32, i32)> = s
            .points
            .iter()
            .filter(|(x, y)| x.is_finite() && y.is_finite() && (!ax.x_log || *x > 0.0))
            .map(|&(x, y)| (ax.px(x), ax.py(y)))
            .collect();
        for w in pts.windows(2) {
            p.line(w[0], w[1], rgb, 2);
        }
        for &pt in &pts {
            p.dot(pt, 7, rgb);
        }
        let ly = TOP + 6 + 18 * i as i32;
        p.line((RIGHT + 16, ly - 4), (RIGHT + 36, ly - 4), rgb, 2);
        p.dot((RIGHT + 26, ly - 4), 7, rgb);
        let mut name = s.name.clone();
        if name.chars().count() > 44 {
            name = name.chars().take(43).collect::<String>() + "~";
        }
        p.text(RIGHT + 42, ly, &name, Anchor::Start, Size::Small, (0, 0, 0));
    }
}

struct Svg(String);

fn rgb_hex((r, g, b): (u8, u8, u8)) -> String {
    format!("#{r:02x}{g:02x}{b:02x}")
}

fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

impl Painter for Svg {
    fn line(&mut self, a: (i32, i32), b: (i32, i32), rgb: (u8, u8, u8), width: u32) {
        self.0.push_str(&format!(
            "<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"{}\" stroke-width=\"{width}\"/>\n",
            a.0,
            a.1,
            b.0,
            b.1,
            rgb_hex(rgb)
        ));
    }

    fn dot(&mut self, c: (i32, i32), diameter: u32, rgb: (u8, u8, u8)) {
        self.0.push_str(&format!(
            "<circle cx=\"{}\" cy=\"{}\" r=\"{}\" fill=\"{}\"/>\n",
            c.0,
            c.1,
            f64::from(diameter) / 2.0,
            rgb_hex(rgb)
        ));
    }

    fn text(&mut self, x: i32, y: i32, s: &str, anchor: Anchor, size: Size, rgb: (u8, u8, u8)) {
        let a = match anchor {
            Anchor::Start => "start",
            Anchor::Middle => "middle",
            Anchor::End => "end",
        };
        let (fs, weight) = match size {
            Size::Small => (11, "normal"),
            Size::Normal => (13, "normal"),
            Size::Title => (15, "bold"),
        };
        self.0.push_str(&format!(
            "<text x=\"{x}\" y=\"{y}\" text-anchor=\"{a}\" font-size=\"{fs}\" font-weight=\"{weight}\" fill=\"{}\">{}</text>\n",
            rgb_hex(rgb),
            xml_escape(s)
        ));
    }
}

/// The chart as an SVG document.
pub fn svg(chart: &Chart) -> String {
    let mut s = Svg(format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{H}\" viewBox=\"0 0 {W} {H}\" font-family=\"sans-serif\">\n<rect width=\"{W}\" height=\"{H}\" fill=\"#ffffff\"/>\n"
    ));
    draw(chart, &mut s);
    s.0.push_str("</svg>\n");
    s.0
}

/// An RGB image to draw on.
struct Canvas {
    px: Vec<u8>,
}

impl OriginDimensions for Canvas {
    fn size(&self) -> embedded_graphics::geometry::Size {
        embedded_graphics::geometry::Size::new(W as u32, H as u32)
    }
}

impl DrawTarget for Canvas {
    type Color = Rgb888;
    type Error = Infallible;

    fn draw_iter<I>(&mut self, pixels: I) -> Result<(), Self::Error>
    where
        I: IntoIterator<Item = Pixel<Self::Color>>,
    {
        for Pixel(p, c) in pixels {
            if (0..W).contains(&p.x) && (0..H).contains(&p.y) {
                let i = 3 * (p.y as usize * W as usize + p.x as usize);
                self.px[i] = c.r();
                self.px[i + 1] = c.g();
                self.px[i + 2] = c.b();
            }
        }
        Ok(())
    }
}

fn color((r, g, b): (u8, u8, u8)) -> Rgb888 {
    Rgb888::new(r, g, b)
}

impl Painter for Canvas {
    fn line(&mut self, a: (i32, i32), b: (i32, i32), rgb: (u8, u8, u8), width: u32) {
        let _ = Line::new(Point::new(a.0, a.1), Point::new(b.0, b.1))
            .into_styled(PrimitiveStyle::with_stroke(color(rgb), width))
            .draw(self);
    }

    fn dot(&mut self, c: (i32, i32), diameter: u32, rgb: (u8, u8, u8)) {
        let _ = Circle::with_center(Point::new(c.0, c.1), diameter)
            .into_styled(PrimitiveStyle::with_fill(color(rgb)))
            .draw(self);
    }

    fn text(&mut self, x: i32, y: i32, s: &str, anchor: Anchor, size: Size, rgb: (u8, u8, u8)) {
        let font = match size {
            Size::Small => &FONT_6X10,
            Size::Normal => &FONT_7X13,
            Size::Title => &FONT_9X15_BOLD,
        };
        let align = match anchor {
            Anchor::Start => Alignment::Left,
            Anchor::Middle => Alignment::Center,
            Anchor::End => Alignment::Right,
        };
        // The bitmap fonts are ASCII only.
        let s: String = s
            .chars()
            .map(|c| if c.is_ascii() { c } else { '?' })
            .collect();
        let _ = Text::with_alignment(
            &s,
            Point::new(x, y),
            MonoTextStyle::new(font, color(rgb)),
            align,
        )
        .draw(self);
    }
}

/// The chart as PNG bytes.
pub fn png(chart: &Chart) -> Result<Vec<u8>> {
    let mut c = Canvas {
        px: vec![255; (W * H * 3) as usize],
    };
    let _ = Rectangle::new(Point::zero(), c.size())
        .into_styled(PrimitiveStyle::with_fill(Rgb888::WHITE))
        .draw(&mut c);
    draw(chart, &mut c);
    let mut out = Vec::new();
    {
        let mut enc = png::Encoder::new(&mut out, W as u32, H as u32);
        enc.set_color(png::ColorType::Rgb);
        enc.set_depth(png::BitDepth::Eight);
        let mut w = enc.write_header().context("encoding PNG header")?;
        w.write_image_data(&c.px).context("encoding PNG data")?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Chart {
        Chart {
            title: "Time to first token".into(),
            x_label: "prompt tokens".into(),
            y_label: "seconds".into(),
            x_log: true,
            series: vec![
                Series {
                    name: "slipstream, 16 slots <aging> & co".into(),
                    points: vec![(1024.0, 8.8), (3072.0, 14.1), (12288.0, 53.4)],
                },
                Series {
                    name: "llama.cpp, mmap".into(),
                    points: vec![(1024.0, 1.2)],
                },
            ],
        }
    }

    #[test]
    fn svg_is_well_formed_and_png_decodes() {
        let s = svg(&sample());
        let doc = roxmltree::Document::parse(&s).expect("valid SVG XML");
        assert_eq!(doc.root_element().tag_name().name(), "svg");
        assert_eq!(
            doc.descendants()
                .filter(|n| n.has_tag_name("circle"))
                .count(),
            4 + 2
        );
        assert!(s.contains("&lt;aging&gt; &amp; co"));
        let bytes = png(&sample()).unwrap();
        let dec = png::Decoder::new(std::io::Cursor::new(bytes));
        let mut r = dec.read_info().unwrap();
        let mut buf = vec![0; r.output_buffer_size()];
        let info = r.next_frame(&mut buf).unwrap();
        assert_eq!((info.width, info.height), (W as u32, H as u32));
        let data = &buf[..info.buffer_size()];
        assert!(data.iter().any(|&b| b != 255), "something was drawn");
        // The first series' colour appears (lines and dots were drawn).
        assert!(data
            .chunks(3)
            .any(|p| p == [PALETTE[0].0, PALETTE[0].1, PALETTE[0].2]));
    }

    #[test]
    fn empty_and_single_point_charts() {
        let mut c = sample();
        c.series.clear();
        assert!(svg(&c).contains("no finished runs"));
        png(&c).unwrap();
        c.x_log = false;
        c.series.push(Series {
            name: "one".into(),
            points: vec![(5.0, 0.0)],
        });
        roxmltree::Document::parse(&svg(&c)).unwrap();
        assert_eq!(nice_ceiling(7.3), 8.0);
        assert_eq!(nice_ceiling(9.3), 10.0);
        assert_eq!(nice_ceiling(0.23), 0.25);
        assert_eq!(tick_label(3072.0), "3k");
    }
}
