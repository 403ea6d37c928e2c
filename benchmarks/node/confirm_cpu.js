// Node amqplib ConfirmChannel, the reference client: COUNT persistent messages of SIZE
// bytes to a fresh durable queue, at most WINDOW unconfirmed, every confirm awaited. Prints one
// JSON line: client CPU (process.cpuUsage(), user + system, all threads) and wall time, first
// publish to last confirm. Run by `benchmarks/client_cpu.py --node`; alone:
//   node benchmarks/node/confirm_cpu.js amqp://guest:guest@127.0.0.1:5672/%2F 100000 12 10000
'use strict';
const amqp = require('amqplib');
const crypto = require('crypto');

async function main() {
  const [url, count, size, window] = [
    process.argv[2] || 'amqp://guest:guest@127.0.0.1:5672/%2F',
    Number(process.argv[3] || 100000),
    Number(process.argv[4] || 12),
    Number(process.argv[5] || 10000),
  ];
  const connection = await amqp.connect(url);
  const channel = await connection.createConfirmChannel();
  const queue = `bench-node-${crypto.randomUUID()}`;
  await channel.assertQueue(queue, { durable: true });
  const body = Buffer.alloc(size, 'x');
  let confirmed = 0;
  let failed = 0;
  let outstanding = 0;
  let wake = null;
  const settled = (err) => {
    if (err) failed += 1;
    else confirmed += 1;
    outstanding -= 1;
    if (wake && outstanding < window) {
      const w = wake;
      wake = null;
      w();
    }
  };
  const wall = process.hrtime.bigint();
  const cpu = process.cpuUsage();
  for (let i = 0; i < count; i += 1) {
    if (outstanding >= window) await new Promise((resolve) => { wake = resolve; });
    outstanding += 1;
    if (!channel.publish('', queue, body, { persistent: true }, settled)) {
      await new Promise((resolve) => channel.once('drain', resolve));
    }
  }
  await channel.waitForConfirms();
  const used = process.cpuUsage(cpu);
  const seconds = Number(process.hrtime.bigint() - wall) / 1e9;
  await channel.deleteQueue(queue);
  await connection.close();
  process.stdout.write(`${JSON.stringify({
    confirmed, failed, cpu_seconds: (used.user + used.system) / 1e6, wall_seconds: seconds,
  })}\n`);
  if (confirmed !== count) process.exit(1);
}

main().catch((err) => { console.error(err); process.exit(2); });
