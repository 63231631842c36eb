// A Conveyor webhook receiver: verify the signature, handle each event once, answer at once.
//
//     CONVEYOR_WEBHOOK_SECRET=whsec_... PORT=8080 node webhook_receiver.js
const http = require("node:http");
const crypto = require("node:crypto");

const TOLERANCE_S = 300; // refuse deliveries signed more than 5 minutes from now (replays)
const seen = new Set(); // webhook-ids already handled (keep them in your database)

// The event, if `body` (a Buffer) was signed with `secret` (`whsec_<base64>`) less than 5 minutes ago.
function verify(secret, headers, body, now = Date.now() / 1000) {
  const id = headers["webhook-id"];
  const stamp = headers["webhook-timestamp"];
  const signatures = headers["webhook-signature"];
  if (!id || !stamp || !signatures) throw new Error("missing webhook headers");
  if (Math.abs(now - Number(stamp)) > TOLERANCE_S) throw new Error("timestamp too old or in the future");
  const key = Buffer.from(secret.replace(/^whsec_/, ""), "base64");
  const expected = crypto.createHmac("sha256", key).update(`${id}.${stamp}.`).update(body).digest();
  for (const signature of signatures.split(" ")) { // one per secret the sender holds (rotation)
    const [version, value = ""] = signature.split(",", 2);
    const given = Buffer.from(value, "base64");
    if (version === "v1" && given.length === expected.length && crypto.timingSafeEqual(given, expected)) {
      return JSON.parse(body.toString("utf8"));
    }
  }
  throw new Error("no signature matches");
}

const server = http.createServer((req, res) => {
  const chunks = [];
  req.on("data", (chunk) => chunks.push(chunk));
  req.on("end", () => {
    let event;
    try {
      event = verify(process.env.CONVEYOR_WEBHOOK_SECRET, req.headers, Buffer.concat(chunks));
    } catch (err) {
      res.writeHead(400).end(err.message);
      return;
    }
    const id = req.headers["webhook-id"];
    if (!seen.has(id)) { // a retry repeats the id
      seen.add(id);
      console.log(event.type, event.data.id); // queue your work here
    }
    res.writeHead(204).end();
  });
});

module.exports = { verify };
if (require.main === module) {
  server.listen(Number(process.env.PORT || 8080), () => console.log("listening on", server.address().port));
}
