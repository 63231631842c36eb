"""Webhooks: a job's events POSTed to its `callback_url`, signed as the Standard Webhooks spec says.

- `ssrf`       the guard every callback URL passes, at submit and again before each attempt, and the
               transport that connects to the address the guard checked (DNS can change in between);
- `signing`    `webhook-id` / `webhook-timestamp` / `webhook-signature` (HMAC-SHA256), secret lookup;
- `events`     job events -> webhook events (`started`, `token` batches, `completed`, `failed`), pure;
- `intake`     the API's side: vet a submit's callback and name the record fields it stores;
- `dispatcher` the process that follows the jobs' event streams and enqueues one delivery per event;
- `delivery`   one attempt: POST, classify, back off, record; the callbacks worker's Celery task.
"""
