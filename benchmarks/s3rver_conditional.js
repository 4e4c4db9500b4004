// s3rver with conditional PUTs: `node s3rver_conditional.js S3RVER_MODULE DIR PORT BUCKET`.
//
// Tansu's S3 storage coordinates through conditional writes (If-None-Match: * to create,
// If-Match: <etag> to update); s3rver 3.7 checks those headers on GET only, so a
// restarted broker, whose caches start empty, would overwrite a partition's watermark
// and its batches. This answers such a PUT 412 when its condition does not hold, the
// check and the write made atomic per key (one node process serves every request).
// A conditional PUT's body is read before its key is locked, so a client that dies
// mid-upload (a broker killed) holds up only its own request, and the object is written
// to a temporary file and renamed, so a GET never reads half of it.
'use strict';

const crypto = require('crypto');
const fs = require('fs/promises');
const path = require('path');

const [modulePath, directory, port, bucket] = process.argv.slice(2);
const S3rver = require(modulePath);

const buffered = new WeakMap(); // request -> its whole body, read before the lock
let temporaries = 0;

function readAll(req) {
  return new Promise((resolve, reject) => {
    const chunks = [];
    req.on('data', chunk => chunks.push(chunk));
    req.on('end', () => resolve(Buffer.concat(chunks)));
    req.on('error', reject);
    req.on('aborted', () => reject(new Error('client aborted the upload')));
  });
}

async function putBuffered(store, object, body) {
  const objectPath = store.getResourcePath(object.bucket, object.key, 'object');
  await fs.mkdir(path.dirname(objectPath), { recursive: true });
  const temporary = `${objectPath}.tmp-${process.pid}-${temporaries++}`;
  await fs.writeFile(temporary, body);
  await fs.rename(temporary, objectPath);
  const md5 = crypto.createHash('md5').update(body).digest('hex');
  await store.putMetadata(object.bucket, object.key, object.metadata, md5);
  return { size: body.length, md5 };
}

const tails = new Map(); // key -> promise of the last conditional PUT queued on it

function locked(key, run) {
  const previous = tails.get(key) || Promise.resolve();
  const current = previous.then(run, run);
  const tail = current.catch(() => {});
  tails.set(key, tail);
  tail.then(() => tails.get(key) === tail && tails.delete(key));
  return current;
}

function unquoted(etag) {
  return etag ? etag.replace(/^W\//, '').replace(/"/g, '') : etag;
}

async function currentEtag(store, bucketName, key) {
  try {
    return (await store.getMetadata(bucketName, key)).etag;
  } catch (err) {
    if (err.code === 'ENOENT') return undefined;
    throw err;
  }
}

async function conditionalPut(ctx, next) {
  const noneMatch = ctx.get('if-none-match');
  const match = ctx.get('if-match');
  if (ctx.method !== 'PUT' || (!noneMatch && !match)) return next();
  const [bucketName, ...rest] = decodeURIComponent(ctx.path).replace(/^\//, '').split('/');
  const key = rest.join('/');
  if (!key) return next();
  buffered.set(ctx.req, await readAll(ctx.req));
  return locked(`${bucketName}/${key}`, async () => {
    const etag = await currentEtag(ctx.store, bucketName, key);
    const failed =
      (noneMatch === '*' && etag !== undefined) ||
      (match && (etag === undefined || unquoted(match) !== unquoted(etag)));
    if (failed) {
      ctx.status = 412;
      ctx.type = 'application/xml';
      ctx.body =
        '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>PreconditionFailed</Code>' +
        '<Message>At least one of the pre-conditions you specified did not hold</Message>' +
        '</Error>';
      return;
    }
    await next();
  });
}

const server = new S3rver({
  address: '127.0.0.1',
  port: Number(port),
  directory,
  silent: true,
  configureBuckets: [{ name: bucket, configs: [] }],
});
// before the router (the last middleware), after s3rver's own request handling setup
server.middleware.splice(server.middleware.length - 1, 0, conditionalPut);
const putObject = server.store.putObject.bind(server.store);
server.store.putObject = object => {
  const body = buffered.get(object.content);
  return body === undefined ? putObject(object) : putBuffered(server.store, object, body);
};
server.run().then(
  () => console.log(`s3rver on 127.0.0.1:${port}, ${directory}, conditional PUTs`),
  err => {
    console.error(err);
    process.exit(1);
  },
);
