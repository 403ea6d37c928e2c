// Node amqplib consumer, the reference for consuming: COUNT messages from QUEUE (filled
// beforehand by benchmarks/consume.py), prefetch PREFETCH, an ack per message (no `multiple`).
// Prints one JSON line: client CPU (process.cpuUsage(), user + system, all threads) and wall
// time, from the first message handled until the COUNT-th ack was written (as every row of
// consume.py: connecting, subscribing and closing are not timed). Run by `benchmarks/consume.py`;
// alone:
//   node benchmarks/node/consume_cpu.js amqp://guest:guest@127.0.0.1:5672/%2F QUEUE 30000 200
'use strict';
const amqp = require('amqplib');

async function main() {
  const [url, queue, count, prefetch] = [
    process.argv[2] || 'amqp://guest:guest@127.0.0.1:5672/%2F',
    process.argv[3],
    Number(process.argv[4] || 30000),
    Number(process.argv[5] || 200),
  ];
  if (!queue) throw new Error('usage: consume_cpu.js URL QUEUE [COUNT] [PREFETCH]');
  const connection = await amqp.connect(url);
  const channel = await connection.createChannel();
  await channel.prefetch(prefetch);
  let consumed = 0;
  let done = null;
  const finished = new Promise((resolve) => { done = resolve; });
  let cpu = null;
  let wall = null;
  let used = null;
  let seconds = 0;
  const onMessage = (message) => {
    if (message === null) return; // cancelled by the broker
    consumed += 1;
    if (consumed === 1) {
      wall = process.hrtime.bigint();
      cpu = process.cpuUsage();
    }
    channel.ack(message);
    if (consumed === count) {
      used = process.cpuUsage(cpu);
      seconds = Number(process.hrtime.bigint() - wall) / 1e9;
      done();
    }
  };
  const { consumerTag } = await channel.consume(queue, onMessage, { noAck: false });
  await finished;
  await channel.cancel(consumerTag);
  await connection.close();
  process.stdout.write(`${JSON.stringify({
    consumed, cpu_seconds: (used.user + used.system) / 1e6, wall_seconds: seconds,
  })}\n`);
}

main().catch((err) => { console.error(err); process.exit(2); });
