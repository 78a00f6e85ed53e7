//! What an estimated step of the expression cost model (`ferry_api::expr::Cost`) takes on this
//! machine: expressions near the budget evaluated on the model's worst-case values (the longest
//! topic, the most elements `json` holds), best of five, beside their estimates. The budget's
//! figures in docs/expressions.md come from here:
//! `cargo run --release -p ferry-api --example expression_cost`.

use std::sync::Arc;
use std::time::Instant;

use cel::objects::{Key, Map};
use cel::{Context, Value};
use ferry_api::expr::{COST_BUDGET, ENV, PAYLOAD_MAX_BYTES, compile};

fn main() {
    let topic = format!("{}a", "a/".repeat(32_767));
    let items: Vec<Value> = (0..(PAYLOAD_MAX_BYTES - 64) / 2)
        .map(|_| Value::Int(1))
        .collect();
    let json = Value::Map(Map {
        map: Arc::new(
            [
                (Key::from("items"), Value::List(Arc::new(items))),
                (Key::from("n"), Value::Int(1)),
            ]
            .into(),
        ),
    });
    let levels = Value::List(Arc::new(topic.split('/').map(Value::from).collect()));
    let nested = |n: usize| {
        (0..n).fold("topic != ''".to_owned(), |e, i| {
            format!("[0,1,2,3,4,5,6,7,8,9].all(v{i}, {e})")
        })
    };
    let sources = [
        nested(4),
        nested(5),
        "json.items.map(x, x > 0, x * 2).size() > 0".to_owned(),
        "json.items.filter(x, x > 0).size() > 0 && json.items.map(x, x > 0, x * 2).size() > 0"
            .to_owned(),
        "json.items.exists_one(z, z == 4)".to_owned(),
        "levels.all(l, l.matches('^[a-z]+$'))".to_owned(),
        "levels.exists(l, l == 'b')".to_owned(),
        "[json, json, json, json]".to_owned(),
        "{'items': json.items, 'n': json.n, 'site': levels[1]}".to_owned(),
    ];
    println!("budget: {COST_BUDGET} steps");
    println!(
        "{:>10} {:>10} {:>9}  expression",
        "estimate", "ms", "ns/step"
    );
    for source in &sources {
        let estimate = match compile(source) {
            Ok(e) => e.cost().steps,
            Err(e) => {
                println!("refused: {e}");
                continue;
            }
        };
        let mut context = Context::with_env(Arc::clone(&ENV));
        context.add_variable_from_value("topic", Value::from(topic.as_str()));
        context.add_variable_from_value("levels", levels.clone());
        context.add_variable_from_value("json", json.clone());
        let program = ENV.compile(source).expect("compiled above");
        let mut best = f64::INFINITY;
        for _ in 0..5 {
            let started = Instant::now();
            let result = program.execute(&context);
            best = best.min(started.elapsed().as_secs_f64());
            assert!(result.is_ok(), "{source}: {result:?}");
        }
        println!(
            "{estimate:>10} {:>10.1} {:>9.1}  {}",
            best * 1e3,
            best * 1e9 / estimate as f64,
            source.chars().take(90).collect::<String>()
        );
    }
}
